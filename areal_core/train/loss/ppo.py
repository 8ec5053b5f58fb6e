"""Naive (coupled) PPO: the baseline of the staleness study.

    r = π_θ/π_behav,   L_t = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),   no π_prox, no behaviour weight.

Schulman et al., "Proximal Policy Optimization Algorithms" (2017), L^CLIP, with the behaviour
(rollout) policy as π_old, as a synchronous trainer would have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_core.train.loss.common import behaviour_kl
from areal_core.train.loss.decoupled_ppo import DecoupledPPO
from areal_core.train.loss.registry import LossInputs, register

if TYPE_CHECKING:
    import torch

    from areal_core.config.algorithm import AlgorithmConfig


@register
class NaivePPO(DecoupledPPO):
    """PPO with the behaviour policy as the old policy: L_t = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),
    r = π_θ/π_behav, w = 1 (`behav_correction` ignored)."""

    name = "ppo"

    def old_logp(self, x: LossInputs) -> torch.Tensor:
        return x.behav_logp

    def behav_correction(self, cfg: AlgorithmConfig) -> str:
        return "none"

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = super().__call__(cfg, x)
        stats["kl_behav_prox"] = behaviour_kl(x.prox_logp, x.behav_logp, x.mask)  # the gap the loss ignores
        return loss, stats
