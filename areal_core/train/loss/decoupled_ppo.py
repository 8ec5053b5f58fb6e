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

from areal_core.train.loss.common import (
    aggregate,
    behaviour_kl,
    behaviour_weights,
    masked_mean,
    per_row,
    usable_behaviour,
)
from areal_core.train.loss.registry import Loss, LossInputs, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float = 0.0,
    behav_weight_cap: float = 0.0,
    *,
    behav_correction: str = "truncate",
    behav_low: float = 0.0,
    behav_high: float | None = None,
    behav_level: str = "token",
    ratio_level: str = "token",
    seq_advantage: bool = True,
    aggregation: str = "token_mean",
    norm_const: float = 0.0,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL), token-mean aggregated by default.

    r = π_θ/π_prox,  w = π_prox/π_behav (see `behaviour_weights`; the cap is `behav_high`, or
    `behav_weight_cap` when `behav_high` is None; no gradient),
    L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),
    with dual clip (c > 1): for A < 0, L_t = w · min(L_t/w, −c·A).
    ratio_level="sequence" is GSPO: r_i = exp(mean_t(log π_θ − log π_prox)) for every token of
    row i, written as sg[r_i]·π_θ(t)/sg[π_θ(t)] so that the gradient is that of r_i; with
    seq_advantage the advantage is also the row's mean Ā_i = mean_t A_t (AReaL's GSPO; without
    it, per-token A_t: the GSPO paper's GSPO-token).
    A token with a non-finite log π_behav or log π_prox is masked (w = 0, no gradient, NaN-free)
    and stays in the denominator, as IcePop-masked tokens do.
    Returns (loss, stats): clip fractions (all, low side, high side, dual) and the ratio mean over
    the kept tokens (keep = 1 in `behaviour_weights`: not masked by IcePop nor non-finite),
    importance-weight statistics and KL(behaviour‖proximal) = mean(log π_behav − log π_prox).
    """
    m = mask.float()
    high = behav_weight_cap if behav_high is None else behav_high
    w, keep, w_stats = behaviour_weights(prox_logp, behav_logp, m, behav_correction, behav_low, high, behav_level)
    usable = usable_behaviour(prox_logp, behav_logp)
    kl = behaviour_kl(prox_logp, behav_logp, m)
    prox_logp = torch.where(usable > 0, prox_logp, logp.detach())  # r = 1 where w = 0: no NaN, no gradient
    log_ratio = logp - prox_logp
    if ratio_level == "sequence":
        seq = per_row(log_ratio.detach(), m * usable, "geometric")
        log_ratio = seq + logp - logp.detach()
        if seq_advantage:  # the row's mean advantage (the "geometric" level of a non-log value)
            advantages = per_row(advantages, m, "geometric")
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected 'token' or 'sequence'")
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped).float()
    dual_hit = torch.zeros_like(per_token)
    if dual_clip > 0:
        bound = -dual_clip * advantages
        dual_hit = ((advantages < 0) & (per_token > bound)).float()
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    loss = aggregate(w * per_token, m, aggregation, norm_const, global_tokens, global_seqs)
    r = ratio.detach()
    kept = m * keep  # the tokens that carry weight: the metrics mean what their names say
    stats = {
        "clip_frac": masked_mean(clip_hit, kept).item(),
        "clip_low_frac": masked_mean(clip_hit * (r < 1).float(), kept).item(),
        "clip_high_frac": masked_mean(clip_hit * (r > 1).float(), kept).item(),
        "dual_clip_frac": masked_mean(dual_hit, kept).item(),
        "ratio_mean": masked_mean(r, kept).item(),
        **w_stats,
        "kl_behav_prox": kl,
    }
    return loss, stats


@register
class DecoupledPPO(Loss):
    """Decoupled PPO (the default): L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), r = π_θ/π_prox,
    w = π_prox/π_behav as `algo.behav_correction` says; `algo.dual_clip` c > 1 bounds L_t ≤ −c·A·w
    for A < 0. Token-level ratio; subclasses change the old policy, the correction or the level."""

    name = "decoupled_ppo"
    needs = frozenset({"advantages"})
    level = "token"
    seq_advantage = False  # with level "sequence": each row's mean advantage Ā_i instead of A_t

    def old_logp(self, x: LossInputs) -> torch.Tensor:
        """The policy the ratio is taken against: π_prox."""
        return x.prox_logp

    def behav_correction(self, cfg: AlgorithmConfig) -> str:
        return cfg.behav_correction

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = decoupled_ppo_loss(
            x.logp,
            self.old_logp(x),
            x.behav_logp,
            x.advantages,
            x.mask,
            cfg.eps_low,
            cfg.eps_high,
            cfg.dual_clip,
            behav_correction=self.behav_correction(cfg),
            behav_low=cfg.behav_low,
            behav_high=cfg.behav_high,
            behav_level=cfg.behav_level,
            ratio_level=self.level,
            seq_advantage=self.seq_advantage,
            aggregation=cfg.aggregation,
            norm_const=cfg.norm_const,
            global_tokens=x.global_tokens,
            global_seqs=x.global_seqs,
        )
        return loss, stats
