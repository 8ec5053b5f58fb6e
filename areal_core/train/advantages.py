"""Advantage estimators: pure functions over reward tensors."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantage per sample.

    A_i = (r_i − mean_g(r)) / (std_g(r) + eps), over the samples i of group g (population std).
    A group whose rewards are all equal gets A = 0 for every sample.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv
