"""GSPO: a sequence-level importance ratio and the sequence's advantage.

    r_i = exp( (1/|y_i|) Σ_t (log π_θ(t) − log π_prox(t)) )          (the geometric mean of token ratios)
    L_t = w · max(−Ā_i·r_i, −Ā_i·clip(r_i, 1−ε_low, 1+ε_high)),      Ā_i = mean_t A_t

Zheng et al., "Group Sequence Policy Optimization" (2025), the GSPO objective; AReaL's GSPO
(`importance_sampling_level: sequence`). With equal token ratios it equals decoupled PPO.
"""

from __future__ import annotations

from areal_core.train.loss.decoupled_ppo import DecoupledPPO
from areal_core.train.loss.registry import LossSettings, register


@register
class GSPO(DecoupledPPO):
    """Decoupled PPO with the sequence ratio r_i = exp(mean_t(log π_θ − log π_prox)) on every token
    of row i (gradient of r_i) and the row's mean advantage Ā_i:
    L_t = w · max(−Ā_i·r_i, −Ā_i·clip(r_i, 1−ε_low, 1+ε_high))."""

    name = "gspo"
    Settings = LossSettings  # none of its own (decoupled PPO's behav_clip_drop is not applied)
    level = "sequence"
    seq_advantage = True
