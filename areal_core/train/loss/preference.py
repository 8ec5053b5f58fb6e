"""What the preference losses (DPO, IPO: `dpo.py`, `ipo.py`) share: pairs from groups, and the margin.

A batch's rows become pairs: each group of exactly two samples with different rewards, the higher
reward chosen (y_w), the other rejected (y_l); other groups are ignored. With sequence
log-probabilities log π(y) = Σ_t log π(y_t) (or their per-token average, `average`):

    h = (log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l)),   loss = mean over pairs of ℓ(h)

A subclass gives ℓ (`pair_losses`) and its settings (β at least, `PreferenceSettings`). Their mean over
pairs has no global denominator, so one rank only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.loss.common import sequence_logprobs
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, get_loss, known_losses

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class PreferenceSettings(LossSettings):
    """What every preference loss reads: β (a subclass per loss, `algo.dpo.beta`, `algo.ipo.beta`)."""

    beta: Float = Field(0.1, gt=0, description="β, the scale of the margin h: how tightly π_θ is tied to π_ref")


class PreferenceLoss(Loss):
    """A loss ℓ(h) on preference pairs (module docstring); not registered itself."""

    needs = frozenset({"ref_logp", "pairs"})
    level = "sequence"
    distributed = False
    kl_term = False  # β in ℓ already ties π_θ to π_ref
    average = False  # True: per-token average log-probs instead of sums

    def pair_losses(self, h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
        """ℓ(h) per pair."""
        raise NotImplementedError

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        pi = sequence_logprobs(x.logp, x.mask, average=self.average)
        ref = sequence_logprobs(x.ref_logp.detach(), x.mask, average=self.average)
        pairs = preference_pairs(x.rewards, x.group_index)
        if pairs is None:
            return x.logp.sum() * 0.0, {"pref_pairs": 0.0}
        c, r = pairs
        settings = self.settings(cfg)
        smoothing = getattr(settings, "label_smoothing", 0.0)
        loss, stats = _on_pairs(self, pi[c], pi[r], ref[c], ref[r], settings.beta, smoothing)
        return loss, {**stats, "pref_pairs": float(len(c))}


def preference_pairs(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(chosen rows, rejected rows) of the groups of exactly two samples with different rewards,
    the higher reward chosen; None when there is no such group."""
    chosen, rejected = [], []
    for g in torch.unique(group_index):
        idx = torch.nonzero(group_index == g).squeeze(1)
        if idx.numel() != 2 or rewards[idx[0]] == rewards[idx[1]]:
            continue
        hi = int(rewards[idx[1]] > rewards[idx[0]])
        chosen.append(idx[hi])
        rejected.append(idx[1 - hi])
    if not chosen:
        return None
    return torch.stack(chosen), torch.stack(rejected)


def _on_pairs(
    loss: PreferenceLoss,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    losses = loss.pair_losses(h, beta, label_smoothing)
    hd = h.detach()
    stats = {
        "pref_accuracy": (hd > 0).float().mean().item(),
        "pref_margin": (beta * hd).mean().item(),
        "pref_chosen_reward": (beta * (policy_chosen - ref_chosen)).detach().mean().item(),
        "pref_rejected_reward": (beta * (policy_rejected - ref_rejected)).detach().mean().item(),
    }
    return losses.mean(), stats


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "dpo",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered preference loss `loss_type` on pairs given as sequence log-probabilities [P]
    each: (mean_P ℓ(h), stats: accuracy 1[h > 0], margin β·h, chosen / rejected rewards)."""
    loss = get_loss(loss_type) if loss_type in known_losses() else None
    if not isinstance(loss, PreferenceLoss):
        names = [n for n in known_losses() if isinstance(get_loss(n), PreferenceLoss)]
        raise ValueError(f"unknown preference loss {loss_type!r}; expected one of {names}")
    return _on_pairs(loss, policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing)
