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

from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.registry import Loss, LossInputs, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


def cispo_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(−w · sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ), r = π_θ/π_prox, w = π_prox/π_behav
    (`x.behaviour(cfg)`); a token with a non-finite log π_behav or log π_prox is masked (w = 0).
    Returns (loss, stats): the fraction of kept tokens whose weight was clipped (all, low, high
    side), the ratio mean, importance-weight statistics and KL(behaviour‖proximal)."""
    b = x.behaviour(cfg)
    ratio = torch.exp(x.logp.detach() - b.anchor(x.prox_logp, x.logp))  # r = 1 where w = 0
    weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = x.reduce(-b.w * weight * x.advantages * x.logp, cfg)
    kept = x.mask.float() * b.keep
    low, high = (ratio < 1 - cfg.eps_low).float(), (ratio > 1 + cfg.eps_high).float()
    stats = {
        "clip_frac": masked_mean(low + high, kept).item(),
        "clip_low_frac": masked_mean(low, kept).item(),
        "clip_high_frac": masked_mean(high, kept).item(),
        "ratio_mean": masked_mean(ratio, kept).item(),
        **b.metrics(),
    }
    return loss, stats


@register
class CISPO(Loss):
    """CISPO: L_t = −w · sg(clip(π_θ/π_prox, 1−ε_low, 1+ε_high)) · A_t · log π_θ(t), token level
    (MiniMax-M1, section 3.1; the formula and its source in the module docstring)."""

    name = "cispo"
    needs = frozenset({"advantages"})
    level = "token"
    advantage_weighted = True  # A = 0 on a row: no loss, no gradient

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return cispo_loss(cfg, x)
