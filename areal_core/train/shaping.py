"""Data shaping before the loss: reward transforms, DAPO's soft overlong penalty, and DAPO's
dynamic sampling as a buffer policy over graded groups."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def shape_rewards(rewards: torch.Tensor, scale: float = 1.0, bias: float = 0.0, clip: float = 0.0) -> torch.Tensor:
    """r' = clip(scale·r + bias, −clip, clip); clip ≤ 0 disables clipping."""
    r = rewards.float() * scale + bias
    return r.clamp(-clip, clip) if clip > 0 else r


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward, per response length |y| (policy tokens):

      0                                  if |y| ≤ L_max − L_cache
      factor · ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
      −factor                            if |y| > L_max
    with L_max = `max_len`, L_cache = `buffer`. max_len ≤ 0 disables it (zeros).
    """
    n = lengths.float()
    if max_len <= 0:
        return torch.zeros_like(n)
    if buffer <= 0:
        return torch.where(n > max_len, torch.full_like(n, -factor), torch.zeros_like(n))
    soft = max_len - buffer
    ramp = (soft - n) / buffer
    return factor * torch.where(n <= soft, torch.zeros_like(n), torch.where(n <= max_len, ramp, -torch.ones_like(n)))


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Per-sample bool [N]: True when the sample's group has rewards that are not all equal."""
    keep = torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        keep[idx] = bool((r.max() - r.min()) > tol)
    return keep


@dataclass
class Selection:
    """What a buffer policy decides: keys of the groups to train now, to keep buffered, to drop."""

    batch: list[Hashable] = field(default_factory=list)
    keep: list[Hashable] = field(default_factory=list)
    dropped: list[Hashable] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return bool(self.batch)


def select_groups(
    groups: Mapping[Hashable, Sequence[Any]],
    num_groups: int,
    reward_of: Callable[[Any], float],
    age_of: Callable[[Any], int],
    *,
    dynamic_sampling: bool = True,
    min_group_size: int = 2,
    tol: float = 1e-6,
) -> Selection:
    """DAPO dynamic sampling as a buffer policy over graded groups (key -> its samples).

    1. With `dynamic_sampling`, groups whose rewards are all equal (zero advantage under any
       group baseline) are dropped: they would only dilute the batch.
    2. The remaining groups are ranked oldest first, by the oldest policy version among their
       samples (`age_of`), ties in buffer (insertion) order. Slow prompts, whose groups finish
       late and therefore carry old versions, come first, so they are never starved by fast
       prompts that keep refilling the buffer.
    3. If at least `num_groups` groups qualify, the `num_groups` oldest form the batch and the
       rest stay buffered; otherwise the batch is empty and every qualifying group waits for the
       rollout side to refill the buffer (the trainer polls again).
    Groups with fewer than `min_group_size` samples are kept (incomplete, still arriving).
    """
    sel = Selection()
    ready: list[tuple[int, int, Hashable]] = []
    for pos, (key, samples) in enumerate(groups.items()):
        if len(samples) < min_group_size:
            sel.keep.append(key)
            continue
        rewards = [float(reward_of(s)) for s in samples]
        if dynamic_sampling and max(rewards) - min(rewards) <= tol:
            sel.dropped.append(key)
            continue
        ready.append((min(age_of(s) for s in samples), pos, key))
    ready.sort(key=lambda x: (x[0], x[1]))
    if len(ready) >= num_groups:
        sel.batch = [k for _, _, k in ready[:num_groups]]
        sel.keep += [k for _, _, k in ready[num_groups:]]
    else:
        sel.keep += [k for _, _, k in ready]
    return sel
