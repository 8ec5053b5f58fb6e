"""Exact accounting (issue 54): every sample the trainer drops gets a record (reason, version,
worker, sample id) at the moment it is dropped, idle drops included, committed with the checkpoint
after it and discarded with a checkpoint that never committed; `row_accounting` settles every
written row from the records alone, so an unrecorded drop shows as a loss."""

from __future__ import annotations

import random
from dataclasses import replace

from areal_core.context import load_run_config
from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.train.accounting import row_accounting
from areal_core.train.batch import GroupBuffer
from areal_core.train.counters import TrainerCounters
from areal_core.train.drops import DropLog, drop_steps, read_drops
from areal_core.train.run_trainer import build_run_trainer
from areal_core.train.sinks import CheckpointSink
from areal_core.train.sources import screen
from areal_core.train.trainer import Trainer
from tests.test_lineage import groups
from tests.test_trainer_seams import prepared, write_groups

STALE_SEQ, FRESH_SEQ = 1, 2


class Feeding(CheckpointSink):
    """Checkpoints as a run does, and feeds it: after step 0 (the trainer now at v1, η = 0) one
    group sampled at v0 arrives, which the trainer drops while it waits for a batch; the first
    time it waits, two fresh groups arrive."""

    def __init__(self, store: Store):
        self.store, self.fed = store, False

    def after_step(self, trainer) -> float:
        super().after_step(trainer)
        if not self.store.exists(LAYOUT.graded_shard("w", STALE_SEQ)):
            write_groups(self.store, STALE_SEQ, 1, version=0)
        return 0.0

    def while_waiting(self, trainer) -> None:
        if not self.fed:
            write_groups(self.store, FRESH_SEQ, 2, version=1)
            self.fed = True


def trainer_on(run_uri: str, store: Store) -> Trainer:
    """The run's trainer (its newest checkpoint restored), fed by `Feeding`."""
    return build_run_trainer(run_uri, load_run_config(store), make_sink=lambda publisher: Feeding(store))


def idle_drop_run(tmp_path) -> tuple[str, Store]:
    run_uri, store = prepared(tmp_path, "train.eta=0", "train.steps=2", "train.checkpoint_every=1")
    write_groups(store, 0, 2, version=0)
    return run_uri, store


def test_drops_made_while_waiting_are_recorded_and_nothing_is_lost(tmp_path):
    run_uri, store = idle_drop_run(tmp_path)
    trainer = trainer_on(run_uri, store)
    trainer.fit()
    assert store.done() and trainer.state.counters.dropped_samples == 4
    stale = [s.identity() for s in groups(random.Random(STALE_SEQ), f"s{STALE_SEQ}", 1, 0, 300)]
    drops = read_drops(store)
    assert sorted(f"{d['worker']}/{d['sample_id']}" for d in drops) == sorted(stale)
    assert {(d["reason"], d["version"], d["worker"], d["trainer_version"]) for d in drops} == {("stale", 0, "w", 1)}
    assert drop_steps(store) == [2]  # committed with the checkpoint after the drop
    rows = row_accounting(store)
    assert (rows["written"], rows["trained"], rows["dropped"], rows["untrained_at_end"]) == (20, 16, 4, 0)
    assert (rows["lost"], rows["trained_twice"], rows["dropped_twice"]) == (0, 0, 0)

    # an unrecorded drop is a loss, exactly: one record removed, one row lost
    record = store.read_json(LAYOUT.drop_record(2))
    gone = record["drops"].pop(1)
    store.write_json(LAYOUT.drop_record(2), record)
    rows = row_accounting(store)
    assert rows["lost"] == 1 and rows["lost_examples"] == [f"w/{gone['sample_id']}"]


def test_a_drop_site_that_skips_its_record_raises_lost_by_its_samples(tmp_path, monkeypatch):
    run_uri, store = idle_drop_run(tmp_path)
    real = DropLog.record

    def forgetting_stale(self, reason, samples, trainer_version):
        if reason != "stale":
            real(self, reason, samples, trainer_version)

    monkeypatch.setattr(DropLog, "record", forgetting_stale)
    trainer_on(run_uri, store).fit()
    rows = row_accounting(store)
    assert (rows["dropped"], rows["lost"]) == (0, 4)  # the counter says 4 dropped; the records hold none


def test_a_drop_file_of_a_checkpoint_that_never_committed_is_discarded_on_resume(tmp_path):
    """Killed after the idle drop with its file written but not the checkpoint's COMMITTED: the
    resumed trainer reads the stale group again (checkpoint 1 had not consumed it), drops it again,
    and the run counts each drop once."""
    run_uri, store = idle_drop_run(tmp_path)
    first = trainer_on(run_uri, store)
    first.start()
    batch = first.source.next_batch(first.state)
    first.step(batch.samples, batch.dropped)  # step 0, checkpoint 1 committed; the stale group arrives
    assert first.source.next_batch(first.state).samples is None  # dropped while waiting
    first.state.drops.commit(store, 2)  # checkpoint 2's drop file, then the kill before its COMMITTED
    assert len(read_drops(store)) == 4
    again = trainer_on(run_uri, store)
    assert again.state.step == 1
    again.fit()
    rows = row_accounting(store)
    assert (rows["dropped"], rows["dropped_twice"], rows["lost"], rows["trained"]) == (4, 0, 0, 16)


def test_screen_records_every_sample_it_removes_with_its_reason():
    rng = random.Random(0)
    stale, fresh, flat, skipped, abandoned = (groups(rng, p, 1, v, 300) for p, v in zip("abcde", (0, 2, 2, 2, 1)))
    flat = [replace(s, reward=1.0) for s in flat]  # all rewards equal: no signal
    skipped = [replace(s, reward_info={"skipped": True, "reward_source": "reward_worker"}) for s in skipped]
    buffer, drops = GroupBuffer(), DropLog()
    buffer.add([*stale, *fresh, *flat, *skipped, *abandoned])
    screen(buffer, 2, 0, [[1, 1]], True, TrainerCounters(), EventLog(None, "trainer", "0"), drops)
    by_reason = {}
    for d in drops.pending:
        by_reason.setdefault(d["reason"], []).append(d["sample_id"])
    assert by_reason == {
        "abandoned_version": [s.sample_id for s in abandoned],
        "reward_skipped": [s.sample_id for s in skipped],
        "stale": [s.sample_id for s in stale],
        "uninformative": [s.sample_id for s in flat],
    }
    assert [s.sample_id for s in buffer.samples()] == [s.sample_id for s in fresh]
    assert {d["trainer_version"] for d in drops.pending} == {2}


def test_a_copied_shard_is_recorded_as_duplicate(tmp_path):
    run_uri, store = prepared(tmp_path)
    write_groups(store, 0, 2)
    store.write_bytes(LAYOUT.graded_shard("w", 9), store.read_bytes(LAYOUT.graded_shard("w", 0)))
    trainer = build_run_trainer(run_uri, load_run_config(store))
    trainer.source.ingest(0)
    assert [d["reason"] for d in trainer.state.drops.pending] == ["duplicate"] * 8
    assert trainer.state.counters.duplicate_samples == 8
