"""Naive (coupled) PPO: the baseline of the staleness study.

    r = π_θ/π_behav,   L_t = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),   no π_prox, no behaviour weight.

Schulman et al., "Proximal Policy Optimization Algorithms" (2017), L^CLIP, with the behaviour
(rollout) policy as π_old, as a synchronous trainer would have it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from areal_core.train.loss.common import behaviour_kl
from areal_core.train.loss.decoupled_ppo import DecoupledPPO, decoupled_ppo_loss
from areal_core.train.loss.registry import LossInputs, LossSettings, register

if TYPE_CHECKING:
    import torch

    from areal_core.config.algorithm import AlgorithmConfig


@register
class NaivePPO(DecoupledPPO):
    """PPO with the behaviour policy as the old policy: L_t = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),
    r = π_θ/π_behav, w = 1 (`behav_correction` ignored): decoupled PPO with π_prox := π_behav."""

    name = "ppo"
    Settings = LossSettings  # none of its own (decoupled PPO's behav_clip_drop is not applied)

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        coupled = dataclasses.replace(x, prox_logp=x.behav_logp)
        loss, stats = decoupled_ppo_loss(cfg, coupled, behaviour=coupled.behaviour(cfg, "none"))
        stats["kl_behav_prox"] = behaviour_kl(x.prox_logp, x.behav_logp, x.mask)  # the gap the loss ignores
        return loss, stats
