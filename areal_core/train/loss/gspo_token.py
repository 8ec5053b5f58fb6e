"""GSPO-token: GSPO's sequence ratio with each token's own advantage.

    s_{i,t} = sg[r_i] · π_θ(t) / sg[π_θ(t)],   L_t = w · max(−A_t·s_{i,t}, −A_t·clip(s_{i,t}, 1−ε_low, 1+ε_high))

Zheng et al., "Group Sequence Policy Optimization" (2025), the GSPO-token variant. Its value
equals GSPO's when nothing clips; its gradient weights ∇log π_θ(t) by A_t instead of Ā_i.
"""

from __future__ import annotations

from areal_core.train.loss.decoupled_ppo import DecoupledPPO
from areal_core.train.loss.registry import LossSettings, register


@register
class GSPOToken(DecoupledPPO):
    """GSPO-token: s_{i,t} = sg[r_i]·π_θ(t)/sg[π_θ(t)] with r_i GSPO's sequence ratio and the
    token's own A_t: L_t = w · max(−A_t·s_{i,t}, −A_t·clip(s_{i,t}, 1−ε_low, 1+ε_high))."""

    name = "gspo_token"
    Settings = LossSettings  # none of its own (decoupled PPO's behav_clip_drop is not applied)
    level = "sequence"
    seq_advantage = False
