"""Online retraining's batch source: finished live sessions, one pass, in near-equal updates.

Live sessions come one per user, not in groups, so rows that share a prompt_id form a group and
the others share one group per update: the baseline is then the update's mean reward,
A_i = (r_i − mean r) / (std r + ε). Rows that are not `admissible` are left out.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from areal_core.config import RunConfig
from areal_core.protocol import Sample, finite_reward
from areal_core.train.checkpoint import TrainerState
from areal_core.train.sources import Batch, BatchSource

log = logging.getLogger("areal.online")


def regroup(samples: list[Sample], pool_id: str) -> list[Sample]:
    """Rows sharing a prompt_id (two or more) form a group; every other row joins `pool_id`."""
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.prompt_id] = counts.get(s.prompt_id, 0) + 1
    return [
        dataclasses.replace(
            s, group_id=f"{pool_id}-{s.prompt_id}" if s.prompt_id and counts[s.prompt_id] > 1 else pool_id
        )
        for s in samples
    ]


def admissible(sample: Sample, low: float, high: float) -> bool:
    """Whether a session row may be trained on: its reward and every token reward finite in
    float32, and within the range its turns can reach, |G| <= (num_turns + 1) * max(|low|, |high|)
    (a return sums at most one reward per turn plus the final one, each in [low, high], γ <= 1);
    and every behaviour log-prob finite."""
    bound = (max(sample.num_turns, 1) + 1) * max(abs(low), abs(high))
    values = [sample.reward] + list(sample.token_rewards or [])
    if not all(map(math.isfinite, sample.behav_logprobs)):  # a NaN log-prob NaNs the update
        return False
    return sample.reward is not None and all(finite_reward(v) and abs(v) <= bound for v in values)


def update_bounds(rows: int, cfg: RunConfig) -> list[int]:
    """Chunk boundaries of one pass over `rows` rows in
    n = min(train.steps, max(1, ⌊rows / (B·G)⌋), max(1, ⌊rows / 2⌋)) near-equal updates:
    b_i = round(i · rows / n), i = 0..n."""
    per_update = cfg.train.batch_groups * cfg.rollout.group_size
    n = min(cfg.train.steps, max(1, rows // per_update), max(1, rows // 2))
    return [round(i * rows / n) for i in range(n + 1)]


class SessionBatches(BatchSource):
    """The admissible rows of `samples` (agent.reward_{min,max} bound them), regrouped, one
    update at a time; exhausted after one pass."""

    def __init__(self, samples: list[Sample], cfg: RunConfig):
        low, high = cfg.agent.reward_min, cfg.agent.reward_max
        kept = [s for s in samples if admissible(s, low, high)]
        self.left_out = len(samples) - len(kept)
        self._unrecorded = [s for s in samples if not admissible(s, low, high)]  # recorded at the first batch
        if self.left_out:
            log.warning("online retraining: %d rows with a reward outside [%g, %g] left out", self.left_out, low, high)
        bounds = update_bounds(len(kept), cfg) if kept else [0]
        self.batches = [regroup(kept[a:b], f"online-{i}") for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def next_batch(self, state: TrainerState) -> Batch | None:
        state.drops.record("inadmissible", self._unrecorded, state.version)
        self._unrecorded = []
        return Batch(self.batches.pop(0)) if self.batches else None
