"""Graded samples -> padded training tensors, and the trainer's group buffer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from areal_core.protocol import Sample
from areal_core.routes import not_recorded
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
    routes: torch.Tensor | None = None  # [N, T, moe_layers, k] recorded expert ids on the host (route_tensor)


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    """Right-padded [N, T] tensors of the samples, T the longest; one tensor built per column."""
    width = max(len(s.input_ids) for s in samples)

    def padded(col: str, fill, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([(v := getattr(s, col)) + [fill] * (width - len(v)) for s in samples], dtype=dtype)

    ids = padded("input_ids", pad_id, torch.long)
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    groups: dict[str, int] = {}
    gidx = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples])
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    return TrainBatch(
        ids,
        attn,
        padded("loss_mask", 0, torch.float32),
        padded("behav_logprobs", 0.0, torch.float32),
        padded("versions", -1, torch.long),
        rewards,
        gidx,
        route_tensor(samples, width),
    )


def route_tensor(samples: list[Sample], width: int) -> torch.Tensor | None:
    """The samples' recorded routes (areal_core/routes.py) as one right-padded [N, width, layers, k]
    tensor on the host, NOT_RECORDED (route_sentinel) at positions not recorded, past a row's end and
    in rows without routes: uint8 (sentinel 255) when every sample's ids are uint8, else int16
    (sentinel −1). None when no sample has any; ValueError when two samples' [layers, k] differ."""
    shapes = {s.routes.shape[1:] for s in samples if s.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples whose routes differ in [layers, k]: {sorted(shapes)}")
    narrow = all(s.routes.dtype == np.uint8 for s in samples if s.routes is not None)
    dtype, fill = (np.uint8, not_recorded(np.uint8)) if narrow else (np.int16, -1)
    out = np.full((len(samples), width, *shapes.pop()), fill, dtype=dtype)
    for i, s in enumerate(samples):
        if s.routes is not None:
            ids = s.routes.astype(dtype)  # uint16 ids fit int16 (no model has 32k experts); its sentinel becomes −1
            ids[s.routes == not_recorded(s.routes.dtype)] = fill
            out[i, : len(ids)] = ids
    return torch.from_numpy(out)


def route_sentinel(routes: torch.Tensor) -> int:
    """What route_tensor writes where nothing was recorded: 255 in uint8, −1 in int16."""
    return 255 if routes.dtype == torch.uint8 else -1


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
