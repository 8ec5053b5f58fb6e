"""The loss registry: one object per loss, found by name; adding a loss is one module in this package.

    class MyLossSettings(LossSettings):  # its own hyperparameters: `algo.my_loss.scale`, validated at prepare
        scale: Float = Field(1.0, gt=0, description="what it scales (the config table shows this)")

    @register
    class MyLoss(Loss):                 # areal_core/train/loss/my_loss.py, and configs/algorithms/my_loss.yaml
        name = "my_loss"                # the value of `algo.loss`, and the section of its settings
        Settings = MyLossSettings
        needs = frozenset({"advantages"})
        level = "token"
        def __call__(self, cfg, x):     # x: LossInputs -> (loss, metrics)
            b = x.behaviour(cfg)        # w = π_prox/π_behav as algo.behav_correction says
            s = MyLossSettings.of(cfg)  # (or self.settings(cfg)): algo.my_loss, defaults filled
            return x.reduce(-s.scale * b.w * x.advantages * x.logp, cfg), b.metrics()

    loss = get_loss(cfg.loss)           # ConfigError naming 'algo.loss' and the known losses
    loss(cfg, LossInputs(logp=..., prox_logp=..., ...))

Two kinds. A **policy** loss is the one `algo.loss` names. A **term** (kind = "term") is added to
every policy loss whose configuration enables it (`enabled`), times `coef(cfg)`: the critic's value
loss under a value-based advantage estimator. Every module of this package is imported on the first
look-up (`discover`), so a new module registers itself with no edit anywhere else.

What a loss declares (checked at registration):
  Settings     its own hyperparameters, a `LossSettings` model of its own (none: the empty one), given
               in config under its name, `algo.<name>.<key>`; `check_algorithm` validates every
               `algo.<name>` section at prepare (`check_settings`) and `complete_settings` writes the
               active losses' sections in full into the stored config
  needs        inputs it reads beyond logp / prox_logp / behav_logp / mask / rewards / group_index:
               'advantages' (computed from the rows when not given), 'ref_logp', 'values',
               'old_values', 'returns', 'pairs' (preference pairs: groups of two samples),
               'teacher_logp' (a teacher model's log-probs, `algo.distill.teacher_path`)
  level        'token' or 'sequence': the unit its ratio (or log-probability) is formed over
  distributed  False: refused with more than one FSDP rank (its reduction has no global denominator)
  kl_term      False: `algo.kl_coef` adds no KL loss term (the loss holds its own β towards π_ref)
  advantage_weighted  True: each row's loss is its advantages times a function of that row alone, so a row
               whose advantages are all 0 adds nothing to the loss or the gradient and the trainer may leave
               it out of the passes (areal_core/train/zero_advantage.py); False (the default) trains every row
  check        what its settings require (`algo.decoupled_ppo.behav_clip_drop`: a token-level correction, and
               decoupled PPO itself as the loss), checked at prepare for each active loss and each loss whose
               section the config sets; a ConfigError naming the key
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Self

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.config.base import ConfigError, ConfigModel
from areal_core.train.loss.common import Behaviour, aggregate, behaviour_correction

if TYPE_CHECKING:
    import torch

log = logging.getLogger("areal.loss")

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


class LossSettings(ConfigModel):
    """A loss's own hyperparameters, given as `algo.<loss name>.<key>`: one subclass per loss, each field
    with bounds and a description (the config table's text, scripts/config_table.py). `register`
    binds a subclass to its loss's name (`section`). This base, with no fields, is a loss without any."""

    section: ClassVar[str] = ""

    @classmethod
    def of(cls, cfg: AlgorithmConfig) -> Self:
        """These settings as `cfg` gives them (`algo.<section>`, defaults for the keys it leaves out);
        ConfigError naming the key ('algo.sapo.tau_pos') for an unknown key or a bad value."""
        if not cls.section:
            raise TypeError(f"{cls.__qualname__} is no registered loss's settings")
        return cls.from_data(cfg.section(cls.section), prefix=f"algo.{cls.section}")


class Loss:
    """One loss. Subclasses set the class attributes below and `__call__`; `@register` files them."""

    name: ClassVar[str]
    Settings: ClassVar[type[LossSettings]] = LossSettings
    kind: ClassVar[str] = "policy"
    needs: ClassVar[frozenset[str]] = frozenset({"advantages"})
    level: ClassVar[str] = "token"
    distributed: ClassVar[bool] = True
    kl_term: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = False

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def settings(self, cfg: AlgorithmConfig) -> LossSettings:
        """This loss's settings as `cfg` gives them (`algo.<name>`; ConfigError naming a bad key)."""
        return self.Settings.from_data(cfg.section(self.name), prefix=f"algo.{self.name}")

    def check(self, cfg: AlgorithmConfig, active: bool) -> None:
        """What this loss's settings require, checked by `check_algorithm` for each active loss and each loss
        whose section `cfg` sets (`active`: whether this loss is one of the active ones); a ConfigError naming
        the key. Nothing by default."""

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
    if name in AlgorithmConfig.model_fields:
        problems.append("a name that is not a shared algo.* key (its settings' section)")
    if not (isinstance(cls.Settings, type) and issubclass(cls.Settings, LossSettings)):
        problems.append("Settings a LossSettings subclass")
    if problems:
        raise TypeError(f"loss class {cls.__qualname__} needs {', '.join(problems)}")
    _bind_settings(cls.Settings, name)
    table = _LOSSES if cls.kind == "policy" else _TERMS
    old = table.get(name)
    if old is not None and (type(old).__module__, type(old).__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"loss {name!r} registered twice: {type(old).__module__} and {cls.__module__}")
    table[name] = cls()
    return cls


def _bind_settings(settings: type[LossSettings], name: str) -> None:
    """File `settings` under the loss `name` (`LossSettings.of` reads algo.<name>); each loss has its own class."""
    if settings is LossSettings:
        return
    if settings.section and settings.section != name:
        raise TypeError(
            f"loss {name!r}: its Settings {settings.__qualname__} are loss {settings.section!r}'s; give each loss "
            "its own class (a subclass will do)"
        )
    settings.section = name


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


def settings_models() -> dict[str, type[LossSettings]]:
    """`algo.<name>` -> the settings model of each registered loss and term that has settings, by name."""
    discover()
    table = {**_LOSSES, **_TERMS}
    return {name: table[name].Settings for name in sorted(table) if table[name].Settings.model_fields}


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
    check_settings(cfg)
    names = [loss.name for loss in active]
    for loss in active + [_LOSSES.get(name) or _TERMS[name] for name in cfg.sections() if name not in names]:
        loss.check(cfg, loss.name in names)
    return active


_unused_sections: set[str] = set()


def check_settings(cfg: AlgorithmConfig) -> None:
    """Every `algo.<name>` section against the settings model of the loss or term `name`: ConfigError
    naming the key for a section that names no registered loss, an unknown key, or a bad value. The
    section of a loss `cfg` does not use (another `algo.loss`; the critic's without a critic
    estimator) is validated as well and logged as unused, once per process: a sweep may keep one
    loss's settings while it switches `algo.loss`, so it is a warning, not a refusal."""
    discover()
    active = {loss.name for loss in active_losses(cfg)}
    for name in cfg.sections():
        loss = _LOSSES.get(name) or _TERMS.get(name)
        if loss is None:
            raise ConfigError(
                f"config key 'algo.{name}' is no setting: a mapping under algo holds the settings of the loss it "
                f"names, and there is no loss {name!r} (the losses and terms: {', '.join(sorted(_LOSSES | _TERMS))})"
            )
        loss.settings(cfg)
        if name not in active and name not in _unused_sections:
            _unused_sections.add(name)
            log.warning(
                "config section 'algo.%s' is set, but algo.loss=%s does not use it: it is ignored", name, cfg.loss
            )


def complete_settings(cfg: AlgorithmConfig) -> AlgorithmConfig:
    """`cfg` with the section of each active loss written out in full (its defaults too): what a run
    stores, so that its config.yaml records the values it trains with, as it does every shared key."""
    full = {loss.name: loss.settings(cfg).model_dump() for loss in active_losses(cfg) if loss.Settings.model_fields}
    return cfg.model_copy(update=full)
