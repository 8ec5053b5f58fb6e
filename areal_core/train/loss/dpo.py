"""DPO on preference pairs (`preference.py` builds the pairs and the margin h).

    ℓ(h) = −(1−ε)·log σ(β h) − ε·log σ(−β h)      (β = `algo.dpo.beta`, ε = `algo.dpo.label_smoothing`; ℓ(0) = log 2)

Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(2023), eq. 7; label smoothing as in the conservative DPO of Mitchell (2023).
"""

from __future__ import annotations

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.loss.preference import PreferenceLoss, PreferenceSettings
from areal_core.train.loss.registry import register


class DpoSettings(PreferenceSettings):
    """`algo.dpo.*`."""

    label_smoothing: Float = Field(
        0.0, ge=0, lt=0.5, description="cDPO's ε: the chance a pair's preference label is flipped"
    )


def dpo_pair_losses(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """−(1−ε)·log σ(β h) − ε·log σ(−β h) per pair."""
    f = torch.nn.functional.logsigmoid
    return -(1 - label_smoothing) * f(beta * h) - label_smoothing * f(-beta * h)


@register
class DPO(PreferenceLoss):
    """DPO: ℓ(h) = −(1−ε)·log σ(β h) − ε·log σ(−β h) on summed sequence log-probabilities,
    h = (log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l))."""

    name = "dpo"
    Settings = DpoSettings

    def pair_losses(self, h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
        return dpo_pair_losses(h, beta, label_smoothing)
