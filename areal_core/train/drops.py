"""The trainer's drop records: every sample it drops gets one, at the moment it is dropped, whether
in a step or while the trainer waits for a batch.

    reason           stale (a token older than v − η), abandoned_version, reward_skipped,
                     uninformative (DAPO's dynamic sampling), duplicate (already consumed under
                     another shard name), inadmissible (a live session row left out)
    worker, sample_id  the sample's identity (`Sample.identity()` is worker/sample_id)
    version          the sample's oldest policy token (`Sample.min_version()`)
    trainer_version  the version the trainer was screening for

Crash consistency is the shards' own: a record is kept in memory (`TrainerState.drops`) until
the next checkpoint writes it, as trainer/drops/step-{N}.json, before that checkpoint's
COMMITTED (train/checkpoint.py); `Trainer.finish` writes what is left before DONE. A trainer
killed between two checkpoints reads the samples it had dropped again (from the previous
checkpoint's pending samples and unconsumed shards) and drops them again; on start it deletes
the drop files of steps after the checkpoint it resumed from (`discard_after`): a checkpoint that
never committed, or that failed verification, wrote them, and their drops are made again. Once
the run is DONE every drop is in exactly one file, and `report/accounting.py` settles every
written row from these records alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from areal_core.layout import LAYOUT
from areal_core.protocol import Sample
from areal_core.store import Store

REASONS = ("stale", "abandoned_version", "reward_skipped", "uninformative", "duplicate", "inadmissible")


@dataclass
class DropLog:
    """The drop records made since the last checkpoint (rank 0, which alone reads batches)."""

    pending: list[dict] = field(default_factory=list)

    def record(self, reason: str, samples: Iterable[Sample], trainer_version: int) -> None:
        """One record per sample of `samples`, dropped for `reason` while screening for `trainer_version`."""
        if reason not in REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; known: {REASONS}")
        self.pending.extend(
            {
                "reason": reason,
                "worker": s.worker_id,
                "sample_id": s.sample_id,
                "version": s.min_version(),
                "trainer_version": trainer_version,
            }
            for s in samples
        )

    def commit(self, store: Store, step: int) -> None:
        """Write the pending records as the drop file of checkpoint `step` (appended to one this
        step already has: the final model's after the last checkpoint) and forget them. Before
        the checkpoint's COMMITTED: a file of a checkpoint that never commits is discarded on resume."""
        if not self.pending:
            return
        rel = LAYOUT.drop_record(step)
        earlier = store.read_json(rel)["drops"] if store.exists(rel) else []
        store.write_json(rel, {"step": step, "drops": earlier + self.pending})
        self.pending = []


def drop_steps(store: Store) -> list[int]:
    """The steps with a drop file, ascending."""
    return sorted(s for name in store.listdir(LAYOUT.drops_dir) if (s := LAYOUT.drop_step(name)) is not None)


def discard_after(store: Store, step: int) -> list[int]:
    """Delete the drop files of steps after `step` (the checkpoint a trainer resumes from, 0 for
    none): their drops are made again. Returns the steps deleted."""
    later = [s for s in drop_steps(store) if s > step]
    for s in later:
        store.delete(LAYOUT.drop_record(s))
    return later


def read_drops(store: Store) -> list[dict]:
    """Every drop record of the run, in step order."""
    return [d for s in drop_steps(store) for d in store.read_json(LAYOUT.drop_record(s))["drops"]]
