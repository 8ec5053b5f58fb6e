"""The loss registry: one object per loss, found by name; adding a loss is one module in this package.

    @register
    class MyLoss(Loss):                 # areal_core/train/loss/my_loss.py, and configs/algorithms/my_loss.yaml
        name = "my_loss"                # the value of `algo.loss`
        needs = frozenset({"advantages"})
        level = "token"
        def __call__(self, cfg, x):     # x: LossInputs -> (loss, metrics)
            b = x.behaviour(cfg)        # w = π_prox/π_behav as algo.behav_correction says
            return x.reduce(-b.w * x.advantages * x.logp, cfg), b.metrics()

    loss = get_loss(cfg.loss)           # ConfigError naming 'algo.loss' and the known losses
    loss(cfg, LossInputs(logp=..., prox_logp=..., ...))

Two kinds. A **policy** loss is the one `algo.loss` names. A **term** (kind = "term") is added to
every policy loss whose configuration enables it (`enabled`), times `coef(cfg)`: the critic's value
loss under a value-based advantage estimator. Every module of this package is imported on the first
look-up (`discover`), so a new module registers itself with no edit anywhere else.

What a loss declares (checked at registration):
  needs        inputs it reads beyond logp / prox_logp / behav_logp / mask / rewards / group_index:
               'advantages' (computed from the rows when not given), 'ref_logp', 'values',
               'old_values', 'returns', 'pairs' (preference pairs: groups of two samples),
               'teacher_logp' (a teacher model's log-probs, `algo.teacher_path`)
  level        'token' or 'sequence': the unit its ratio (or log-probability) is formed over
  distributed  False: refused with more than one FSDP rank (its reduction has no global denominator)
  kl_term      False: `algo.kl_coef` adds no KL loss term (the loss holds its own β towards π_ref)
  clip_drop    True: it applies `algo.behav_clip_drop` (else a ConfigError when that is set)
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from areal_core.config.base import ConfigError
from areal_core.train.loss.common import Behaviour, aggregate, behaviour_correction

if TYPE_CHECKING:
    import torch

    from areal_core.config.algorithm import AlgorithmConfig

INPUTS = frozenset({"advantages", "ref_logp", "values", "old_values", "returns", "pairs", "teacher_logp"})
LEVELS = ("token", "sequence")
KINDS = ("policy", "term")


@dataclass(frozen=True)
class LossInputs:
    """What a loss reads. Per-token tensors are [N, T], aligned with input positions
    (logp[:, t] = log π(x_t | x_<t)); rewards and group_index are [N]. logp and values carry the
    gradient; the rest are constants. `global_tokens` / `global_seqs`: the denominators of the
    whole (mini)batch when this is one rank's share of it (else None: these rows' own)."""

    logp: torch.Tensor
    prox_logp: torch.Tensor
    behav_logp: torch.Tensor
    mask: torch.Tensor  # float, 1 on policy tokens
    rewards: torch.Tensor
    group_index: torch.Tensor
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    global_tokens: float | None = None
    global_seqs: float | None = None

    def reduce(self, per_token: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
        """`per_token` aggregated as configured (`algo.aggregation`, `algo.norm_const`)."""
        return aggregate(per_token, self.mask, cfg.aggregation, cfg.norm_const, self.global_tokens, self.global_seqs)

    def behaviour(self, cfg: AlgorithmConfig, mode: str | None = None) -> Behaviour:
        """The behaviour correction of these rows (`behaviour_correction`) as `algo.behav_correction`,
        `behav_low`, `behav_high` and `behav_level` configure it; `mode` overrides the correction."""
        return behaviour_correction(
            self.prox_logp,
            self.behav_logp,
            self.mask,
            mode or cfg.behav_correction,
            cfg.behav_low,
            cfg.behav_high,
            cfg.behav_level,
        )


class Loss:
    """One loss. Subclasses set the class attributes below and `__call__`; `@register` files them."""

    name: ClassVar[str]
    kind: ClassVar[str] = "policy"
    needs: ClassVar[frozenset[str]] = frozenset({"advantages"})
    level: ClassVar[str] = "token"
    distributed: ClassVar[bool] = True
    kl_term: ClassVar[bool] = True
    clip_drop: ClassVar[bool] = False

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def enabled(self, cfg: AlgorithmConfig, policy: Loss) -> bool:
        """A term: whether it joins `policy` under `cfg` (policy losses: never called)."""
        return False

    def coef(self, cfg: AlgorithmConfig) -> float:
        """A term: its weight in the total loss."""
        return 1.0

    def __repr__(self) -> str:
        return f"<{self.kind} loss {self.name!r}>"


_LOSSES: dict[str, Loss] = {}
_TERMS: dict[str, Loss] = {}
_discovered = False


def register(cls: type[Loss]) -> type[Loss]:
    """Class decorator: file one instance of `cls` under `cls.name` (a TypeError names what is wrong)."""
    name = getattr(cls, "name", "")
    problems = []
    if not (isinstance(name, str) and name.isidentifier()):
        problems.append("a name (an identifier)")
    if cls.kind not in KINDS:
        problems.append(f"kind in {KINDS}")
    if cls.level not in LEVELS:
        problems.append(f"level in {LEVELS}")
    if not cls.needs <= INPUTS:
        problems.append(f"needs within {sorted(INPUTS)}")
    if problems:
        raise TypeError(f"loss class {cls.__qualname__} needs {', '.join(problems)}")
    table = _LOSSES if cls.kind == "policy" else _TERMS
    old = table.get(name)
    if old is not None and (type(old).__module__, type(old).__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"loss {name!r} registered twice: {type(old).__module__} and {cls.__module__}")
    table[name] = cls()
    return cls


def discover() -> None:
    """Import every module of this package once, so that each registers its losses."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        importlib.import_module(f"{__package__}.{info.name}")
    _discovered = True


def known_losses() -> list[str]:
    """The names `algo.loss` may take, sorted."""
    discover()
    return sorted(_LOSSES)


def get_loss(name: str) -> Loss:
    """The policy loss named `name`; ConfigError naming 'algo.loss' and the known losses otherwise."""
    discover()
    if name not in _LOSSES:
        known = ", ".join(repr(n) for n in sorted(_LOSSES))
        raise ConfigError(
            f"config key 'algo.loss' must be one of the registered losses ({known}; "
            f"areal_core/train/loss/), got {name!r}"
        )
    return _LOSSES[name]


def terms(cfg: AlgorithmConfig, policy: Loss) -> list[Loss]:
    """The terms `cfg` adds to `policy`, in name order."""
    discover()
    return [t for _, t in sorted(_TERMS.items()) if t.enabled(cfg, policy)]


def active_losses(cfg: AlgorithmConfig) -> list[Loss]:
    """The policy loss `algo.loss` names, then the terms it enables (ConfigError for an unknown name)."""
    policy = get_loss(cfg.loss)
    return [policy, *terms(cfg, policy)]


def check_algorithm(cfg: AlgorithmConfig, distributed: bool = False, micro_batches: bool = False) -> list[Loss]:
    """Validate `algo.loss` against the registry (and, with `distributed` or `micro_batches`, that
    every active loss splits over rows: more than one rank, or train.max_tokens_per_micro_batch)
    before any work starts; returns the active losses. ConfigError."""
    active = active_losses(cfg)
    refused = [loss.name for loss in active if not loss.distributed]
    where = "on more than one rank" if distributed else "in micro-batches (train.max_tokens_per_micro_batch > 0)"
    if (distributed or micro_batches) and refused:
        raise ConfigError(
            f"config key 'algo.loss': {', '.join(refused)} cannot run {where}: it needs all of a minibatch's rows "
            f"at once (algo.loss={cfg.loss}, algo.adv_estimator={cfg.adv_estimator})"
        )
    policy = get_loss(cfg.loss)
    if cfg.behav_clip_drop != "none" and not policy.clip_drop:
        raise ConfigError(
            f"config key 'algo.behav_clip_drop': algo.loss={cfg.loss} does not apply it; the losses that do: "
            f"{sorted(name for name in known_losses() if get_loss(name).clip_drop)}"
        )
    return active
