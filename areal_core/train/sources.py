"""Where the trainer's samples come from: a `BatchSource` hands it one `Batch` per step.

    GradedShards     the run's graded shards (a fork's frozen list of its parent's shards is one
                     more input of the same source), buffered by group, screened by the hard
                     staleness bound, the B oldest groups taken;
    RecordedBatches  replay: the batches an earlier run trained, in its order, at its versions;
    SessionBatches   online retraining from live sessions (areal_core/online/session_batches.py).

Every source screens with the one `screen` rule, so a replay under another η drops exactly what
the run's trainer would have dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.forks import ForkRef, image_roots
from areal_core.layout import LAYOUT
from areal_core.protocol import DEFAULT_LIMITS, Sample, ShardLimits, read_shard_or_quarantine, unique
from areal_core.shard_feed import ShardFeed, ungraded_gaps
from areal_core.store import Store
from areal_core.train.backlog import BacklogRecorder
from areal_core.train.batch import GroupBuffer
from areal_core.train.checkpoint import TrainerState
from areal_core.train.counters import TrainerCounters
from areal_core.train.drops import DropLog
from areal_core.train.lineage import holds_version_in

log = logging.getLogger("areal.trainer")


@dataclass
class Batch:
    """One step's input. `samples` None: too few groups yet (the trainer waits and asks again);
    empty: nothing of this step survived screening (the step is skipped)."""

    samples: list[Sample] | None
    dropped: list[Sample] = field(default_factory=list)  # beyond the hard bound
    abandoned: list[Sample] = field(default_factory=list)  # a token of an abandoned version
    version: int | None = None  # the trainer version to train at (replay: the record's); None: the trainer's own
    times: tuple[float, float, float] | None = None  # (read start, read end, built): the read and batch_build spans
    record: dict | None = None  # replay: the audit record this batch reproduces


class BatchSource(ABC):
    """Rank 0's supplier of batches. `next_batch` returns None once the source is exhausted."""

    @abstractmethod
    def next_batch(self, state: TrainerState) -> Batch | None: ...

    def pending(self) -> list[Sample]:
        """Samples read but not trained yet (saved with a checkpoint)."""
        return []

    def save_into(self, state: TrainerState) -> None:
        """Record what the source has consumed in `state` before a checkpoint."""
        return None


@dataclass
class Screened:
    dropped: list[Sample]
    abandoned: list[Sample]
    filtered: list[Sample]
    skipped: list[Sample] = field(default_factory=list)

    def untrained(self) -> list[Sample]:
        """Every sample screened out, whatever the reason."""
        return [*self.abandoned, *self.dropped, *self.filtered, *self.skipped]


def screen(
    buffer: GroupBuffer,
    version: int,
    eta: int,
    abandoned_ranges: list[list[int]],
    dynamic_sampling: bool,
    counters: TrainerCounters,
    events: EventLog,
    drops: DropLog,
) -> Screened:
    """Remove from `buffer` what the trainer producing version+1 must not train: samples of an
    abandoned version, samples with a token older than version − η (groups left with < 2 samples
    go whole), samples the reward skipped (every reward function returned None: TRL's
    convention; reward/signatures.py), and under DAPO's dynamic sampling the groups whose rewards
    are all equal. Each sample removed gets a drop record (train/drops.py)."""
    abandoned = buffer.drop_where(lambda s: holds_version_in(s, abandoned_ranges)) if abandoned_ranges else []
    skipped = _drop_skipped(buffer)
    if skipped:
        counters.skipped_samples += len(skipped)
        events.emit("drop", reason="reward_skipped", n=len(skipped))
    dropped = buffer.drop_stale(version, eta)
    filtered = buffer.drop_uninformative() if dynamic_sampling else []
    removed = {"abandoned_version": abandoned, "reward_skipped": skipped, "stale": dropped, "uninformative": filtered}
    for reason, samples in removed.items():
        drops.record(reason, samples, version)
    if filtered:
        groups = len({s.group_id for s in filtered})
        counters.filtered_groups += groups
        events.emit("drop", reason="uninformative", n=len(filtered), groups=groups)
    return Screened(dropped, abandoned, filtered, skipped)


def reward_skipped(sample: Sample) -> bool:
    """Every reward function returned None for `sample` as the reward workers graded it (an agent's
    own info cannot mark it; a human label's reward un-skips it: reward/labels.py)."""
    info = sample.reward_info or {}
    return info.get("skipped") is True and info.get("reward_source") == "reward_worker"


def _drop_skipped(buffer: GroupBuffer) -> list[Sample]:
    """Remove and return the skipped samples, and the whole group of one left with < 2 samples;
    a group without a skipped sample is not touched (a short group is the other rules' to judge)."""
    out: list[Sample] = []
    for gid in [g for g, group in buffer.groups.items() if any(map(reward_skipped, group))]:
        kept = [s for s in buffer.groups[gid] if not reward_skipped(s)]
        if len(kept) < 2:
            out.extend(buffer.groups.pop(gid))
        else:
            out.extend(s for s in buffer.groups[gid] if reward_skipped(s))
            buffer.groups[gid] = kept
    return out


class GradedShards(BatchSource):
    """The run's graded shards: each shard read once (`consumed`), each sample used once
    (`seen`, by identity: a copied shard adds nothing), a corrupt shard quarantined; a fork
    first reads the parent shards its reference froze (never quarantined there: it is not
    the fork's root)."""

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
        self.store, self.cfg, self.ev, self.fork, self.limits = store, cfg, events, fork, limits
        self.image_roots = image_roots(store) if cfg.model.kind == "vlm" else None  # a fork's parents hold images too
        self.check: Callable[[Sample], str | None] | None = None  # a VLM's PlaceholderCheck (run_trainer sets it)
        self.counters, self.drops = state.counters, state.drops
        self._trainer_version = state.version  # the version the last ingest read for (a duplicate's record)
        self.consumed = set(state.consumed)
        # the graded layer from a cursor per worker: a poll lists what is new, not the run
        self.feed = ShardFeed(store, LAYOUT.graded_dir, handled=self.consumed, gaps=ungraded_gaps(store))
        self.seen = set(state.seen)
        self.buffer = GroupBuffer()
        self.buffer.add(list(pending))
        self._backlog = BacklogRecorder(store, events)

    def ingest(self, version: int | None = None) -> int:
        """Read the shards not read yet into the buffer; returns how many of the root's own were new.
        `version`: the trainer's; a shard with a policy token of a later version is quarantined
        (no rollout can have sampled with weights not yet published)."""
        self._trainer_version = self._trainer_version if version is None else version
        new = [p for p in self.feed.poll() if p not in self.consumed]
        self._backlog(self.feed, new, len(self.buffer))
        for rel in self.fork.unread(self.consumed) if self.fork else []:
            self._add(rel, self.fork.read_shard(rel, self.limits))  # later versions: off the fork's lineage
        own = dataclasses.replace(self.limits, max_version=version)
        for rel in new:
            self._add(rel, read_shard_or_quarantine(self.store, rel, self.ev, own, self.image_roots, self._problem))
        return len(new)

    def _problem(self, sample: Sample) -> str | None:
        """Why a graded row cannot be trained on: no reward (every grading path sets one, so the
        shard was not written by a reward worker), or the VLM's placeholder check."""
        if sample.reward is None:
            return f"sample {sample.sample_id[:100]!r} in a graded shard has no reward"
        return self.check(sample) if self.check is not None else None

    def _add(self, rel: str, samples: list[Sample] | None) -> None:
        self.consumed.add(rel)
        self.feed.handled(rel)
        if samples is None:
            self.counters.quarantined_shards += 1
            log.warning("corrupt shard %s skipped", rel)
            return
        fresh = unique(samples, self.seen)
        if len(fresh) < len(samples):
            n = len(samples) - len(fresh)
            self.counters.duplicate_samples += n
            self.ev.emit("drop", reason="duplicate", n=n)
            kept = {id(s) for s in fresh}
            self.drops.record("duplicate", [s for s in samples if id(s) not in kept], self._trainer_version)
            log.warning("shard %s: %d samples already consumed, skipped", rel, n)
        self.buffer.add(fresh)

    def next_batch(self, state: TrainerState) -> Batch:
        t0 = time.time()
        self.ingest(state.version)
        t1 = time.time()
        tc = self.cfg.train
        dynamic = self.cfg.algo.dynamic_sampling
        out = screen(self.buffer, state.version, tc.eta, state.abandoned, dynamic, self.counters, self.ev, self.drops)
        self._give_back_admission(out.untrained())
        samples = self.buffer.take(tc.batch_groups)
        return Batch(samples, out.dropped, out.abandoned, times=(t0, t1, time.time()))

    def _give_back_admission(self, discarded: list[Sample]) -> None:
        """Count the groups that left the buffer untrained and publish the total for admission
        (rollout/admission.py starts that many more groups)."""
        gone = {s.group_id for s in discarded} - set(self.buffer.groups)
        if not gone:
            return
        self.counters.discarded_groups += len(gone)
        self.store.write_json(LAYOUT.discarded_groups, {"groups": self.counters.discarded_groups})

    def pending(self) -> list[Sample]:
        return self.buffer.samples()

    def save_into(self, state: TrainerState) -> None:
        state.consumed = sorted(self.consumed)
        state.seen = sorted(self.seen)


class RecordedBatches(BatchSource):
    """Replay: each audit record's samples in their order, at the record's trainer version,
    screened under this config (a smaller η drops, dynamic sampling filters; the order kept)."""

    def __init__(self, records: list[dict], lookup: dict[str, Sample], cfg: RunConfig, events: EventLog):
        self.batches = [(rec, [lookup[i] for i in record_ids(rec)]) for rec in records]
        self.cfg, self.ev = cfg, events
        self.skipped: list[int] = []  # the records' steps left without samples

    def next_batch(self, state: TrainerState) -> Batch | None:
        if not self.batches:
            return None
        rec, samples = self.batches.pop(0)
        buffer = GroupBuffer()
        buffer.add(samples)
        version = rec["trainer_version"]
        dynamic = self.cfg.algo.dynamic_sampling
        out = screen(buffer, version, self.cfg.train.eta, [], dynamic, state.counters, self.ev, state.drops)
        kept = buffer.samples()
        if not kept:
            self.skipped.append(rec["step"])
        return Batch(kept, out.dropped, version=version, record=rec)


def record_ids(rec: dict) -> list[str]:
    """The identities (`Sample.identity()`: worker/sample id) an audit record's step trained, in
    order; records older than `sample_workers` name sample ids only."""
    if "sample_workers" not in rec:
        return [sid for sid, _ in rec["samples"]]
    return [f"{w}/{sid}" for w, (sid, _) in zip(rec["sample_workers"], rec["samples"])]
