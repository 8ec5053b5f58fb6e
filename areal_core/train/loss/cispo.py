"""CISPO: clip the importance-sampling weight, not the update, so that every token keeps its gradient.

MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (2025,
arXiv:2506.13585), section 3.1, the CISPO objective:

    J(θ) = E[ (1 / Σ_i |o_i|) Σ_i Σ_t  sg(r̂_{i,t}(θ)) · Â_{i,t} · log π_θ(o_{i,t} | q, o_{i,<t}) ],
    r̂_{i,t}(θ) = clip(r_{i,t}(θ), 1 − ε_low, 1 + ε_high),   r_{i,t}(θ) = π_θ(o_{i,t}) / π_old(o_{i,t}),

a token-level mean (`aggregation: token_mean`). Decoupled as the other losses here: π_old is the
proximal policy and the behaviour weight w = π_prox/π_behav (`behav_correction`, no gradient)
corrects for staleness, so that, per policy token t,

    L_t = −w · sg(clip(π_θ/π_prox, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(t),
    ∇L_t = −w · clip(r, 1 − ε_low, 1 + ε_high) · A_t · ∇log π_θ(t).

With π_prox = π_behav (synchronous, one minibatch: w = 1, r = 1) it is the paper's J(θ), negated.
Unlike PPO's clip, a token whose ratio leaves the range keeps its gradient, only its weight is capped.
The paper leaves the lower bound off (ε_low large) and tunes ε_high.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal_core.train.loss.common import aggregate, behaviour_kl, behaviour_weights, masked_mean, usable_behaviour
from areal_core.train.loss.registry import Loss, LossInputs, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


def cispo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    *,
    behav_correction: str = "truncate",
    behav_low: float = 0.0,
    behav_high: float = 5.0,
    behav_level: str = "token",
    aggregation: str = "token_mean",
    norm_const: float = 0.0,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(−w · sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ), r = π_θ/π_prox, w = π_prox/π_behav
    (`behaviour_weights`); a token with a non-finite log π_behav or log π_prox is masked (w = 0).
    Returns (loss, stats): the fraction of kept tokens whose weight was clipped (all, low, high
    side), the ratio mean, importance-weight statistics and KL(behaviour‖proximal)."""
    m = mask.float()
    w, keep, w_stats = behaviour_weights(prox_logp, behav_logp, m, behav_correction, behav_low, behav_high, behav_level)
    kl = behaviour_kl(prox_logp, behav_logp, m)
    prox_logp = torch.where(usable_behaviour(prox_logp, behav_logp) > 0, prox_logp, logp.detach())  # r = 1 where w = 0
    ratio = torch.exp(logp.detach() - prox_logp)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = aggregate(-w * weight * advantages * logp, m, aggregation, norm_const, global_tokens, global_seqs)
    kept = m * keep
    low, high = (ratio < 1 - eps_low).float(), (ratio > 1 + eps_high).float()
    stats = {
        "clip_frac": masked_mean(low + high, kept).item(),
        "clip_low_frac": masked_mean(low, kept).item(),
        "clip_high_frac": masked_mean(high, kept).item(),
        "ratio_mean": masked_mean(ratio, kept).item(),
        **w_stats,
        "kl_behav_prox": kl,
    }
    return loss, stats


@register
class CISPO(Loss):
    """CISPO: L_t = −w · sg(clip(π_θ/π_prox, 1−ε_low, 1+ε_high)) · A_t · log π_θ(t), token level
    (MiniMax-M1, section 3.1; the formula and its source in the module docstring)."""

    name = "cispo"
    needs = frozenset({"advantages"})
    level = "token"

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return cispo_loss(
            x.logp,
            x.prox_logp,
            x.behav_logp,
            x.advantages,
            x.mask,
            cfg.eps_low,
            cfg.eps_high,
            behav_correction=cfg.behav_correction,
            behav_low=cfg.behav_low,
            behav_high=cfg.behav_high,
            behav_level=cfg.behav_level,
            aggregation=cfg.aggregation,
            norm_const=cfg.norm_const,
            global_tokens=x.global_tokens,
            global_seqs=x.global_seqs,
        )
