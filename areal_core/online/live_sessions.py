"""Continuous online RL's batch source: the graded session shards serving proxies write into the
run root (`python -m areal_core.proxy --follow RUN/weights --store RUN`), under the trainer's own rules.

AReaL #1481: online sessions bypassed the capacity and staleness rules. Here a live session is a
sample like a rollout's: its served tokens carry the trainer versions the proxy served them with,
and before each step `sources.screen`, the one rule every source applies, drops every row whose
oldest served token is older than v − η (v the trainer's version), counted as the trainer counts
every stale sample (`dropped_samples`, a `drop` event, the step's audit record). Shards are read
once and rows used once, by identity, exactly as `GradedShards` does (it is one).

Live sessions come one per user, not in groups, so they are regrouped as online retraining
regroups them (`session_batches.regroup`: rows sharing a prompt_id form a group, the others one
pool whose baseline is its mean reward) and rows that are not `admissible` are left out. A step
waits until B·G rows (train.batch_groups × rollout.group_size) are pending, screens them, and
trains the B·G oldest that survive; the rest wait for the next step.

Every row read is settled once, per proxy (the folder its shard was in), when it is trained, dropped,
left out, a duplicate, or in a quarantined shard; the totals are
saved with each checkpoint (`TrainerState.settled`) and published as `trainer/live_settled.json`,
from which a serving proxy applies the admission rule to sessions (`staleness.sessions_admissible`,
proxy/backpressure.py): when live traffic outruns the trainer, new sessions get a 429 rather than
piling up unread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.forks import ForkRef
from areal_core.layout import LAYOUT
from areal_core.online.session_batches import admissible, regroup
from areal_core.protocol import DEFAULT_LIMITS, Sample, ShardLimits, shard_rows
from areal_core.store import Store
from areal_core.train.batch import GroupBuffer
from areal_core.train.checkpoint import TrainerState
from areal_core.train.sources import Batch, GradedShards, screen


class LiveSessions(GradedShards):
    """The run's graded session shards, B·G admissible rows a step, screened by `screen`."""

    def __init__(
        self,
        store: Store,
        cfg: RunConfig,
        state: TrainerState,
        events: EventLog,
        *,
        fork: ForkRef | None = None,
        pending: Iterable[Sample] = (),
        limits: ShardLimits = DEFAULT_LIMITS,
    ):
        super().__init__(store, cfg, state, events, fork=fork, pending=pending, limits=limits)
        self.rows = cfg.train.batch_groups * cfg.rollout.group_size
        self.left_out = 0  # rows not admissible (a reward out of range, a non-finite log-prob)
        self.settled = dict(state.settled)  # proxy worker id -> its rows trained, dropped, left out, lost
        self._owner: dict[str, str] = {}  # a buffered row's identity -> the proxy whose shard held it
        self._published: dict[str, int] | None = None

    def _settle(self, rows: Iterable[Sample]) -> None:
        for s in rows:
            self._settle_to(self._owner.pop(s.identity(), s.worker_id), 1)

    def _settle_to(self, owner: str, n: int) -> None:
        if n:
            self.settled[owner] = self.settled.get(owner, 0) + n

    def _add(self, rel: str, samples: list[Sample] | None) -> None:
        """As GradedShards reads a shard, and: its rows belong to the proxy named by its folder (the
        one that counted them as written), and rows that will never train are settled now: the
        duplicates, and every row of a quarantined shard that parses at all."""
        owner = LAYOUT.shard_worker(rel)
        before = {s.identity() for s in self.buffer.samples()}
        super()._add(rel, samples)
        if samples is None:
            self._settle_to(owner, shard_rows(self.store, LAYOUT.quarantined(rel)))
            return
        added = {s.identity() for s in samples} & ({s.identity() for s in self.buffer.samples()} - before)
        self._owner.update((i, owner) for i in added)
        self._settle_to(owner, len(samples) - len(added))

    def _publish_settled(self) -> None:
        if self.settled != self._published:
            self.store.write_json(LAYOUT.live_settled, {"rows": self.settled})
            self._published = dict(self.settled)

    def save_into(self, state: TrainerState) -> None:
        super().save_into(state)
        state.settled = dict(self.settled)

    def _hold(self, samples: list[Sample]) -> None:
        self.buffer = GroupBuffer()
        self.buffer.add(samples)

    def next_batch(self, state: TrainerState) -> Batch:
        try:
            return self._next_batch(state)
        finally:
            self._publish_settled()

    def _next_batch(self, state: TrainerState) -> Batch:
        t0 = time.time()
        self.ingest(state.version)
        t1 = time.time()
        low, high = self.cfg.agent.reward_min, self.cfg.agent.reward_max
        rows = [s for s in self.buffer.samples() if admissible(s, low, high)]
        if len(self.buffer.samples()) > len(rows):
            out_of_range = [s for s in self.buffer.samples() if not admissible(s, low, high)]
            self.left_out += len(out_of_range)
            self._settle(out_of_range)
            self.ev.emit("drop", reason="inadmissible", n=len(out_of_range))
            self.drops.record("inadmissible", out_of_range, state.version)
        if len(rows) < self.rows:  # too few to screen yet: a lone row is never a group of its own
            self._hold(rows)
            return Batch(None, times=(t0, t1, time.time()))
        pool = GroupBuffer()
        pool.add(regroup(rows, f"live-{state.step}"))
        tc, dynamic = self.cfg.train, self.cfg.algo.dynamic_sampling
        out = screen(pool, state.version, tc.eta, state.abandoned, dynamic, self.counters, self.ev, self.drops)
        self._settle(out.untrained())
        arrival = {s.identity(): i for i, s in enumerate(rows)}  # the oldest first, then first come
        kept = sorted(pool.samples(), key=lambda s: (s.min_version(), arrival[s.identity()]))
        if len(kept) < self.rows:
            self._hold(kept)
            return Batch(None, out.dropped, out.abandoned, times=(t0, t1, time.time()))
        self._hold(kept[self.rows :])
        self._settle(kept[: self.rows])
        batch = regroup(kept[: self.rows], f"live-{state.step}")
        return Batch(batch, out.dropped, out.abandoned, times=(t0, t1, time.time()))
