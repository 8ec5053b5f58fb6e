"""IPO on preference pairs (`preference.py` builds the pairs and the margin h).

    ℓ(h) = (h − 1/(2β))²      on per-token average log-probabilities   (β = `algo.ipo.beta`)

Azar et al., "A General Theoretical Paradigm to Understand Learning from Human Preferences"
(2023), the empirical IPO loss.
"""

from __future__ import annotations

import torch

from areal_core.train.loss.preference import PreferenceLoss, PreferenceSettings
from areal_core.train.loss.registry import register


class IpoSettings(PreferenceSettings):
    """`algo.ipo.*`."""


def ipo_pair_losses(h: torch.Tensor, beta: float) -> torch.Tensor:
    """(h − 1/(2β))² per pair."""
    return (h - 1 / (2 * beta)) ** 2


@register
class IPO(PreferenceLoss):
    """IPO: ℓ(h) = (h − 1/(2β))² with h from per-token average log-probabilities, as in the paper."""

    name = "ipo"
    Settings = IpoSettings
    average = True

    def pair_losses(self, h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
        return ipo_pair_losses(h, beta)
