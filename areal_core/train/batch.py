"""Graded samples -> padded training tensors, and the trainer's group buffer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_core.protocol import Sample
from areal_core.staleness import is_fresh


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, T] right-padded
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T] 1 on policy-produced tokens
    behav_logprobs: torch.Tensor  # [N, T]
    versions: torch.Tensor  # [N, T]
    rewards: torch.Tensor  # [N]
    group_index: torch.Tensor  # [N]


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    width = max(len(s.input_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    behav = torch.zeros((n, width), dtype=torch.float32)
    vers = torch.full((n, width), -1, dtype=torch.long)
    groups: dict[str, int] = {}
    for i, s in enumerate(samples):
        t = len(s.input_ids)
        ids[i, :t] = torch.tensor(s.input_ids)
        attn[i, :t] = 1
        mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behav[i, :t] = torch.tensor(s.behav_logprobs)
        vers[i, :t] = torch.tensor(s.versions)
        groups.setdefault(s.group_id, len(groups))
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    gidx = torch.tensor([groups[s.group_id] for s in samples])
    return TrainBatch(ids, attn, mask, behav, vers, rewards, gidx)


class GroupBuffer:
    """Graded groups waiting to be trained, oldest policy version first."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, list[Sample]] = OrderedDict()

    def add(self, samples: list[Sample]) -> None:
        for s in samples:
            self.groups.setdefault(s.group_id, []).append(s)

    def __len__(self) -> int:
        return len(self.groups)

    def samples(self) -> list[Sample]:
        return [s for g in self.groups.values() for s in g]

    def drop_stale(self, trainer_version: int, eta: int) -> list[Sample]:
        """Remove and return every sample that breaks the hard bound; groups left with < 2 samples go too."""
        return self.drop_where(lambda s: not is_fresh(s.min_version(), trainer_version, eta))

    def drop_where(self, bad: Callable[[Sample], bool]) -> list[Sample]:
        """Remove and return every sample for which `bad` holds; groups left with < 2 samples go too."""
        dropped: list[Sample] = []
        for gid in list(self.groups):
            fresh = [s for s in self.groups[gid] if not bad(s)]
            stale = [s for s in self.groups[gid] if s not in fresh]
            if len(fresh) < 2:
                dropped.extend(self.groups.pop(gid))
            elif stale:
                dropped.extend(stale)
                self.groups[gid] = fresh
        return dropped

    def drop_uninformative(self) -> list[Sample]:
        """DAPO dynamic sampling: remove and return groups whose rewards are all equal (no signal)."""
        dropped: list[Sample] = []
        for gid in list(self.groups):
            rewards = {float(s.reward or 0.0) for s in self.groups[gid]}
            if len(rewards) == 1:
                dropped.extend(self.groups.pop(gid))
        return dropped

    def take(self, num_groups: int) -> list[Sample] | None:
        """The `num_groups` oldest groups (by their oldest token version), or None if too few."""
        if len(self.groups) < num_groups:
            return None
        order = sorted(self.groups, key=lambda g: min(s.min_version() for s in self.groups[g]))
        out: list[Sample] = []
        for gid in order[:num_groups]:
            out.extend(self.groups.pop(gid))
        return out
