"""Background publication (issue 57, idle cores put to work): a version's store writes run on a helper
thread while the next step trains, in order, drained before a checkpoint, a repair check and the final
model; an error there stops the trainer at its next publication. Behaviour only, no timing."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.config.loading import load_config
from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.online.promotion import PromotingSink
from areal_core.report.series import timeline
from areal_core.report.timing import role_time
from areal_core.store import Store
from areal_core.train.checkpoint import TrainerState
from areal_core.train.in_flight import InFlight
from areal_core.train.sinks import PublishingSink
from areal_core.weights.publisher import WeightPublisher
from areal_core.weights.reader import load_weights_bytes


class RecordingStore(Store):
    """Records (thread name, path) of every write; `fail_version`: its weights file write raises."""

    def __init__(self, uri: str, fail_version: int | None = None):
        super().__init__(uri)
        self.writes: list[tuple[str, str]] = []
        self.fail_version = fail_version
        self._lock = threading.Lock()

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.fail_version is not None and rel == LAYOUT.weights_file(self.fail_version, "model.safetensors"):
            raise OSError("store refused the write")
        with self._lock:
            self.writes.append((threading.current_thread().name, rel))
        super().write_bytes(rel, data)


class Dist:
    is_main, distributed, world_size = True, False, 1

    @staticmethod
    def broadcast_object(obj: Any) -> Any:
        return obj


@dataclass
class FakeTrainer:
    """What PublishingSink uses of the trainer; each version's weights are one tensor holding the version."""

    store: Store
    cfg: Any
    state: TrainerState = field(default_factory=TrainerState)
    lora: bool = False
    tokenizer: Any = None
    dist: Dist = field(default_factory=Dist)
    checkpoints: list[tuple[int, int | None]] = field(default_factory=list)  # (step, LATEST when saved)

    def __post_init__(self) -> None:
        self.ev = EventLog(None, "trainer", "0")

    def weights_bytes(self) -> bytes:
        return st_save({"w": torch.full((4,), float(self.state.version))})

    def save_checkpoint(self, model_bytes: bytes | None = None, gathered: bool = False) -> None:
        self.checkpoints.append((self.state.step, self.store.latest_version()))

    def take_step(self, sink: PublishingSink) -> float:
        self.state.step += 1
        self.state.version += 1
        return sink.after_step(self)


class OnDrain(InFlight):
    """Runs a job only when drained: what the sink writes before its drains is all it can rely on."""

    def __init__(self) -> None:
        super().__init__(background=False)
        self._queued: list = []

    def submit(self, job):  # type: ignore[no-untyped-def]
        self.drain()
        self._queued.append(job)

    def drain(self):  # type: ignore[no-untyped-def]
        out = [job() for job in self._queued]
        self._queued.clear()
        return out[-1] if out else None


def make(tmp_path, background: bool = True, fail_version: int | None = None) -> tuple[FakeTrainer, PublishingSink]:
    store = RecordingStore(str(tmp_path / "run"), fail_version)
    cfg = load_config(None, [f"train.background_publish={str(background).lower()}", "train.checkpoint_every=2"])
    trainer = FakeTrainer(store, cfg)
    sink = PublishingSink(WeightPublisher(store, {}))
    sink.start(trainer)
    return trainer, sink


def version_writes(store: RecordingStore, version: int) -> list[tuple[str, str]]:
    prefix = LAYOUT.weights_dir(version)
    return [(t, rel) for t, rel in store.writes if rel.startswith(prefix + "/") or rel == LAYOUT.latest]


def test_versions_are_written_off_the_trainers_thread_in_order(tmp_path):
    trainer, sink = make(tmp_path)
    for _ in range(5):
        trainer.take_step(sink)
    sink.finish(trainer)
    store = trainer.store
    main = threading.current_thread().name
    latest_writes = [(t, rel) for t, rel in store.writes if rel == LAYOUT.latest]
    assert len(latest_writes) == 6  # v0 at start, then v1..v5
    assert latest_writes[0][0] == main  # the resumed version, before the first step: on the trainer's thread
    assert all(t != main for t, _ in latest_writes[1:])  # v1..v5: on the helper
    weights_paths = [rel for _, rel in store.writes if rel.endswith("model.safetensors")]
    assert weights_paths == [LAYOUT.weights_file(v, "model.safetensors") for v in range(6)]  # in order
    for v in range(1, 6):  # each version: its files, then its manifest, then LATEST
        rels = [rel for _, rel in store.writes]
        weights, manifest = rels.index(LAYOUT.weights_file(v, "model.safetensors")), rels.index(LAYOUT.manifest(v))
        assert weights < manifest < rels.index(LAYOUT.latest, manifest)
        assert load_weights_bytes(store, v) == st_save({"w": torch.full((4,), float(v))})  # verified, exact
    assert store.latest_version() == 5


def test_off_the_switch_writes_on_the_trainers_thread(tmp_path):
    trainer, sink = make(tmp_path, background=False)
    for _ in range(3):
        assert trainer.take_step(sink) > 0
    main = threading.current_thread().name
    assert {t for t, _ in trainer.store.writes} == {main}
    assert trainer.store.latest_version() == 3


def test_checkpoint_repair_check_and_finish_wait_for_the_version_in_flight(tmp_path):
    trainer, sink = make(tmp_path)
    sink._in_flight = OnDrain()  # a job runs only when the sink drains
    trainer.take_step(sink)  # v1 queued, not written
    assert trainer.store.latest_version() == 0
    trainer.take_step(sink)  # step 2 checkpoints: v1 must be in the store first
    trainer.take_step(sink)
    trainer.take_step(sink)  # step 4 checkpoints: v3 first
    assert trainer.checkpoints == [(2, 1), (4, 3)]
    assert trainer.store.latest_version() == 3  # v4 in flight
    sink.while_waiting(trainer)  # the readers' reports are of v4: it is written before they are read
    assert trainer.store.latest_version() == 4
    trainer.take_step(sink)
    sink.finish(trainer)  # before the final model and DONE
    assert trainer.store.latest_version() == 5


def test_a_failed_background_write_stops_the_trainer_at_its_next_publication(tmp_path):
    trainer, sink = make(tmp_path, fail_version=2)
    trainer.take_step(sink)
    trainer.take_step(sink)  # step 2 waits for v1 before its checkpoint; v2's write fails on the helper
    with pytest.raises(OSError, match="store refused"):
        trainer.take_step(sink)  # v3 waits for v2 first: the error surfaces on the trainer's thread
    assert trainer.store.latest_version() == 1  # LATEST never named the version whose files failed
    assert not trainer.store.exists(LAYOUT.manifest(2))
    assert not trainer.store.exists(LAYOUT.manifest(3))  # nothing after it was published


def span(on: str, t0: float, t1: float, state: str = "busy") -> dict[str, Any]:
    return {"role": "trainer", "worker": "0", "kind": "span", "t": t1, "state": state, "on": on, "t0": t0, "t1": t1}


def test_the_helpers_writes_are_reported_apart_from_the_trainers_busy_and_waiting_time():
    """10 s: train 6, publish 1 (the bytes), then a 3 s wait for the batch during which the helper
    writes the version for 2 s. Counted as trainer busy, the write made busy + waiting 120%."""
    records = [
        span("train", 0.0, 6.0),
        span("publish", 6.0, 7.0),
        span("batch", 7.0, 10.0, "wait"),
        span("publish_background", 7.0, 9.0, "background"),
    ]
    trainer = role_time(records)["trainer"]
    assert trainer.busy == pytest.approx(0.7) and trainer.wait == pytest.approx(0.3)
    assert trainer.wait_on == {"batch": pytest.approx(0.3)}
    assert trainer.background_on == {"publish_background": pytest.approx(0.2)}
    lanes = timeline(records, 0.0)
    assert lanes["trainer-0"] == {"busy": [(0.0, 7.0)], "wait:batch": [(7.0, 3.0)]}
    assert lanes["trainer-0 helper"] == {"background:publish_background": [(7.0, 2.0)]}


def test_the_sink_records_the_helpers_writes_as_background_and_its_own_part_as_publish(tmp_path):
    trainer, sink = make(tmp_path)
    sink._in_flight = OnDrain()  # v1's write runs inside the wait, as while_waiting's drain does
    sink._in_flight.background = True
    trainer.ev._pending.clear()
    trainer.take_step(sink)
    with trainer.ev.span("batch", "wait"):
        sink.while_waiting(trainer)
    assert trainer.store.latest_version() == 1
    records = [{"role": "trainer", "worker": "0", **json.loads(line)} for line in trainer.ev._pending]
    spans = [(r["on"], r["state"]) for r in records if r["kind"] == "span"]
    assert spans == [("publish", "busy"), ("publish", "busy"), ("publish_background", "background"), ("batch", "wait")]
    shares = role_time(records)["trainer"]
    assert shares.busy + shares.wait <= 1.0
    assert shares.background_on["publish_background"] > 0


class Gate:
    """The promotion gate's offers, each with the store's LATEST when it was offered."""

    champion_score, tracking_uri = 0.0, None

    def __init__(self, store: Store):
        self.store, self.offered = store, []

    def offer(self, version: int, step: int, score: float, folder: str, score_current: Any = None) -> bool:
        self.offered.append((version, self.store.latest_version()))
        return False


class ScoringTrainer(FakeTrainer):
    def full_model(self) -> None:
        return None

    def score(self, model: Any) -> float:
        return 1.0


def make_promoting(tmp_path, monkeypatch, fail_version: int | None = None) -> tuple[ScoringTrainer, PromotingSink]:
    monkeypatch.setattr("areal_core.models.save_pretrained", lambda model, tokenizer, folder: None)
    store = RecordingStore(str(tmp_path / "run"), fail_version)
    cfg = load_config(None, ["train.background_publish=true", "train.checkpoint_every=100"])
    trainer = ScoringTrainer(store, cfg)
    sink = PromotingSink(WeightPublisher(store, {}), Gate(store), every=2)
    sink.start(trainer)
    return trainer, sink


def test_a_version_is_offered_for_promotion_only_after_its_write(tmp_path, monkeypatch):
    trainer, sink = make_promoting(tmp_path, monkeypatch)
    sink._in_flight = OnDrain()  # a write runs only when the sink drains
    for _ in range(4):
        trainer.take_step(sink)
    assert sink.gate.offered == [(2, 2), (4, 4)]  # LATEST already named the version offered


def test_a_failed_background_write_is_never_offered_for_promotion(tmp_path, monkeypatch):
    trainer, sink = make_promoting(tmp_path, monkeypatch, fail_version=2)
    trainer.take_step(sink)
    with pytest.raises(OSError, match="store refused"):
        trainer.take_step(sink)  # v2's write fails on the helper: raised before the offer
    assert sink.gate.offered == []
    assert trainer.store.latest_version() == 1
