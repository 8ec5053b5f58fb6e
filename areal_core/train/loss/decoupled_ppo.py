"""Decoupled PPO (AReaL): the proximal policy π_prox anchors the clip, π_prox/π_behav corrects for staleness.

    r = π_θ/π_prox,   w = π_prox/π_behav (no gradient; `behav_correction`: truncate / mask / none),
    L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),   dual clip c > 1: for A < 0, L_t ≤ −c·A·w,
    aggregated as `algo.aggregation` (token-mean by default).

The decoupled objective of Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning" (2025). `decoupled_ppo_loss` is the pure function; `ppo.py`,
`gspo.py` and `gspo_token.py` are its variants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import ConfigError
from areal_core.train.loss.common import BehavClipDrop, Behaviour, drop_clipped, masked_mean, per_row
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class DecoupledPpoSettings(LossSettings):
    """`algo.decoupled_ppo.*`: decoupled PPO's own settings (its variants, `ppo`, `gspo`, `gspo_token`, have none)."""

    behav_clip_drop: BehavClipDrop = Field(
        "none",
        description="a control of the staleness study: also drop the tokens naive PPO's clip against π_behav "
        "removes, A > 0 with π_prox/π_behav > 1 + ε_high (positive), and A < 0 with π_prox/π_behav < 1 − ε_low "
        "(both); a token-level correction only (algo.behav_level=token)",
    )


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, as a loss:

        L_t = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),   dual clip c > 1: for A < 0, L_t = min(L_t, −c·A).

    Returns (L, clip_hit, dual_hit): 1 where the clipped term is the larger, 1 where the dual bound binds."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped).float()
    dual_hit = torch.zeros_like(per_token)
    if dual_clip > 0:
        bound = -dual_clip * advantages
        dual_hit = ((advantages < 0) & (per_token > bound)).float()
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    return per_token, clip_hit, dual_hit


def decoupled_ppo_loss(
    cfg: AlgorithmConfig,
    x: LossInputs,
    *,
    level: str = "token",
    seq_advantage: bool = False,
    behaviour: Behaviour | None = None,
    clip_drop: str = "none",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL) on `x`, aggregated as `algo.aggregation`:

        r = π_θ/π_prox,   w = π_prox/π_behav (`x.behaviour(cfg)`, or `behaviour` when given; no gradient),
        L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),   dual clip c > 1: for A < 0, L_t = w · min(L_t/w, −c·A).

    level="sequence" is GSPO: r_i = exp(mean_t(log π_θ − log π_prox)) for every token of row i,
    written as sg[r_i]·π_θ(t)/sg[π_θ(t)] so that the gradient is that of r_i; with `seq_advantage`
    the advantage is also the row's mean Ā_i = mean_t A_t (AReaL's GSPO; without it, per-token A_t:
    the GSPO paper's GSPO-token).
    A token with a non-finite log π_behav or log π_prox is masked (w = 0, no gradient, NaN-free)
    and stays in the denominator, as IcePop-masked tokens do.
    `clip_drop` (`algo.decoupled_ppo.behav_clip_drop`; with `behaviour` not given) also drops the tokens
    naive PPO's clip would remove (`drop_clipped`).
    Returns (loss, stats): clip fractions (all, low side, high side, among A > 0, among A < 0, dual)
    and the ratio mean over the kept tokens (`Behaviour.keep`: not masked by the correction, dropped
    nor non-finite), importance-weight statistics and KL(behaviour‖proximal) = mean(log π_behav − log π_prox).
    """
    m = x.mask.float()
    if behaviour is None:
        b = x.behaviour(cfg)
        b = drop_clipped(b, x.prox_logp, x.behav_logp, x.advantages, m, clip_drop, cfg.eps_low, cfg.eps_high)
    else:
        b = behaviour
    log_ratio = x.logp - b.anchor(x.prox_logp, x.logp)
    advantages = x.advantages
    if level == "sequence":
        seq = per_row(log_ratio.detach(), m * b.usable, "geometric")
        log_ratio = seq + x.logp - x.logp.detach()
        if seq_advantage:  # the row's mean advantage (the "geometric" level of a non-log value)
            advantages = per_row(advantages, m, "geometric")
    elif level != "token":
        raise ValueError(f"unknown ratio level {level!r}; expected 'token' or 'sequence'")
    ratio = torch.exp(log_ratio)
    per_token, clip_hit, dual_hit = clipped_surrogate(ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    loss = x.reduce(b.w * per_token, cfg)
    r = ratio.detach()
    kept = m * b.keep  # the tokens that carry weight: the metrics mean what their names say
    stats = {
        "clip_frac": masked_mean(clip_hit, kept).item(),
        "clip_low_frac": masked_mean(clip_hit * (r < 1).float(), kept).item(),
        "clip_high_frac": masked_mean(clip_hit * (r > 1).float(), kept).item(),
        "clip_frac_adv_pos": masked_mean(clip_hit, kept * (advantages > 0).float()).item(),
        "clip_frac_adv_neg": masked_mean(clip_hit, kept * (advantages < 0).float()).item(),
        "dual_clip_frac": masked_mean(dual_hit, kept).item(),
        "ratio_mean": masked_mean(r, kept).item(),
        **b.metrics(),
    }
    return loss, stats


@register
class DecoupledPPO(Loss):
    """Decoupled PPO (the default): L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), r = π_θ/π_prox,
    w = π_prox/π_behav as `algo.behav_correction` says; `algo.dual_clip` c > 1 bounds L_t ≤ −c·A·w
    for A < 0. Token-level ratio; subclasses change the level (`gspo.py`, `gspo_token.py`) or the
    old policy and the correction (`ppo.py`)."""

    name = "decoupled_ppo"
    Settings = DecoupledPpoSettings  # its subclasses have none: they set LossSettings
    needs = frozenset({"advantages"})
    level = "token"
    advantage_weighted = True  # A = 0 on a row (Ā = 0 at sequence level): no loss, no gradient
    seq_advantage = False  # with level "sequence": each row's mean advantage Ā_i instead of A_t

    def clip_drop(self, cfg: AlgorithmConfig) -> str:
        """`algo.decoupled_ppo.behav_clip_drop` for decoupled PPO itself; "none" for its variants."""
        return DecoupledPpoSettings.of(cfg).behav_clip_drop if self.Settings is DecoupledPpoSettings else "none"

    def check(self, cfg: AlgorithmConfig, active: bool) -> None:
        """`behav_clip_drop` set: refused unless decoupled PPO itself is the loss (not a run that silently trains
        without the drop) and the correction is token-level."""
        if DecoupledPpoSettings.of(cfg).behav_clip_drop == "none":
            return
        if not (active and self.Settings is DecoupledPpoSettings):
            raise ConfigError(
                f"config key 'algo.decoupled_ppo.behav_clip_drop': algo.loss={cfg.loss} does not apply it; "
                f"the losses that do: ['{DecoupledPPO.name}']"
            )
        if cfg.behav_level != "token":
            raise ConfigError(
                f"config key 'algo.decoupled_ppo.behav_clip_drop' applies to a token-level correction only "
                f"(algo.behav_level=token), got algo.behav_level={cfg.behav_level}"
            )

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return decoupled_ppo_loss(
            cfg, x, level=self.level, seq_advantage=self.seq_advantage, clip_drop=self.clip_drop(cfg)
        )
