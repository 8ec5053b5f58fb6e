"""Where the trainer's versions go: a `Sink` is told when the trainer starts and after every step.

    PublishingSink   the run: publish weights/v{N} (under LoRA the adapter alone) after every step,
                     checkpoint every `train.checkpoint_every` steps and at the last; on start,
                     publish the resumed weights under a number no other weights ever had
                     (train/lineage.py);
    CheckpointSink   checkpoints only (a trainer nothing rolls out from);
    NullSink         nothing: replay and online retraining keep only their final model.

Checkpoint before publishing: a restart then republishes identical weights under the same number
(or, from an older checkpoint, continues after the newest published one). The methods are
collective: every rank calls them; rank 0 alone writes.

With `train.background_publish` a version's store writes (publisher, prune) run on a helper thread
while the next step trains (train/in_flight.py: one in flight, in order; drained before a checkpoint,
a repair and the final model); its bytes are taken on the trainer's thread first. The trainer's
thread records "publish" spans (the bytes, the wait for the previous write), the helper its
"publish_background" spans as "background" (events.py): they overlap the trainer's busy and waiting
time, and the report counts them as neither.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.train.checkpoint import TrainerState
from areal_core.train.in_flight import InFlight
from areal_core.train.lineage import newest_published, resume_version
from areal_core.weights.faults import (
    RepairPolicy,
    VersionCheck,
    VersionUnloadable,
    check_readers_left,
    reports,
    retire,
)
from areal_core.weights.publisher import WeightPublisher, prune

log = logging.getLogger("areal.trainer")


class Trainer(Protocol):
    """What a sink uses of the trainer (train/trainer.py)."""

    cfg: RunConfig
    state: TrainerState
    store: Store
    ev: EventLog
    dist: Any
    lora: bool

    tokenizer: Any

    def weights_bytes(self) -> bytes | None: ...
    def evaluate(self) -> float: ...
    def score(self, model: Any) -> float: ...
    def full_model(self) -> Any: ...
    def adapter_files(self) -> dict[str, bytes]: ...
    def save_checkpoint(self, model_bytes: bytes | None = None, gathered: bool = False) -> None: ...


class Sink:
    """The no-op sink; subclasses override what they do."""

    def start(self, trainer: Trainer) -> None:
        """Before the first step."""

    def after_step(self, trainer: Trainer) -> float:
        """After `trainer.state` counts the step just taken; returns the seconds spent publishing."""
        return 0.0

    def while_waiting(self, trainer: Trainer) -> None:
        """Called (collectively) while the trainer waits for a batch."""

    def drain(self, trainer: Trainer) -> None:
        """Before a checkpoint: every version before it in the store (nothing left in flight)."""

    def finish(self, trainer: Trainer) -> None:
        """Before the final model: nothing left in flight."""


class NullSink(Sink):
    """Publishes and checkpoints nothing (replay, online retraining)."""


def checkpoint_due(trainer: Trainer) -> bool:
    tc, step = trainer.cfg.train, trainer.state.step
    return step % tc.checkpoint_every == 0 or step == tc.steps


class CheckpointSink(Sink):
    def after_step(self, trainer: Trainer) -> float:
        if checkpoint_due(trainer):
            with trainer.ev.span("checkpoint"):
                trainer.save_checkpoint()
        return 0.0


class PublishingSink(CheckpointSink):
    """`readers`: the readers of the versions, whom the run needs one of (weights/faults.py); None:
    the run's rollout workers; () (continuous online RL: proxies): the session writers found."""

    def __init__(self, publisher: WeightPublisher, readers: Sequence[str] | None = None):
        self.publisher, self.readers = publisher, readers
        self.repair_policy = RepairPolicy()
        self._check: VersionCheck | None = None
        self._next_fault_check = 0.0
        self._in_flight: InFlight | None = None

    def in_flight(self, trainer: Trainer) -> InFlight:
        """Where rank 0's publications run (train.background_publish: a helper thread)."""
        if self._in_flight is None:
            self._in_flight = InFlight(trainer.cfg.train.background_publish)
        return self._in_flight

    def drain(self, trainer: Trainer) -> None:
        if self._in_flight is not None:
            self._in_flight.drain()

    def finish(self, trainer: Trainer) -> None:
        if self._in_flight is not None:
            self._in_flight.close()
            self._in_flight = None

    def while_waiting(self, trainer: Trainer) -> None:
        """The readers' reports of the newest version (weights/faults.py), read at most every
        max(1 s, 10 rollout polls) after the last check ended: a version that fails its check is
        republished whole; a reader that fails one that verifies is retired; a version that cannot
        be repaired, or no reader left, stops the run with the reason (VersionUnloadable on every
        rank). The check is advice: a store error in it is logged and the trainer goes on waiting."""
        decision: tuple[str, str] | None = None
        if trainer.dist.is_main:
            self.in_flight(trainer).drain()  # the readers' reports are of the newest version: in the store first
        if trainer.dist.is_main and time.monotonic() >= self._next_fault_check:
            version, store = trainer.state.version, trainer.store
            if self._check is None:
                self._check = VersionCheck(store)
            try:
                decision = (self._decide(trainer), "")
            except VersionUnloadable as exc:
                decision = ("stop", str(exc))
                trainer.ev.emit("version_unloadable", version=version, reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - an unreadable store: checked again later
                log.warning("checking the readers' reports of weights v%d failed: %s", version, exc)
            self._next_fault_check = time.monotonic() + max(1.0, 10 * trainer.cfg.rollout.poll_interval_s)
        decision = trainer.dist.broadcast_object(decision)
        if decision is None or decision[0] == "wait":
            return
        if decision[0] == "stop":
            raise VersionUnloadable(decision[1])
        blob = None if trainer.lora else trainer.weights_bytes()  # collective: every rank
        if trainer.dist.is_main:
            version = trainer.state.version
            log.warning("weights v%d fails its check for its readers: republished whole", version)
            self.repair_policy.repaired(version)
            seconds = self.publisher.republish(version, trainer.adapter_files() if trainer.lora else blob)
            trainer.ev.emit("republish", version=version, bytes=self.publisher.last_weights_bytes, seconds=seconds)

    def _decide(self, trainer: Trainer) -> str:
        """The policy's decision on the reports (rank 0); the readers it retires are recorded."""
        store, version = trainer.store, trainer.state.version
        found = reports(store)
        decision = self.repair_policy.decide(version, found, self._check)
        for r in decision.retire:
            log.error("%s fails weights v%d, which verifies in the store: retired (%s)", r.worker, r.version, r.error)
            retire(store, r)
            trainer.ev.emit("reader_retired", reader=r.worker, version=r.version, failures=r.failures, error=r.error)
        if self.repair_policy.retired:
            check_readers_left(self._known_readers(trainer, found), self.repair_policy.retired)
        return decision.action

    def _known_readers(self, trainer: Trainer, found: list) -> set[str]:
        if self.readers is None:
            return {f"rollout-{i}" for i in range(trainer.cfg.rollout.num_workers)}
        writers = trainer.store.listdir(LAYOUT.ungraded_dir)  # continuous: the proxies' session folders
        return {*self.readers, *writers, *(r.worker for r in found)}

    def start(self, trainer: Trainer) -> None:
        st, dist = trainer.state, trainer.dist
        decision = None
        if dist.is_main:
            decision = resume_version(st.version, newest_published(trainer.store), trainer.store.latest_version())
        decision = dist.broadcast_object(decision)
        if decision.abandoned is not None:
            lo, hi = decision.abandoned
            log.warning(
                "checkpoint version %d is older than published v%d: publishing it as v%d; v%d..v%d abandoned",
                *(st.version, hi, decision.version, lo, hi),
            )
            st.abandoned.append([lo, hi])
        st.version = decision.version
        if decision.publish:
            blob = None if trainer.lora else trainer.weights_bytes()  # collective
            if dist.is_main:
                self.publish(trainer, blob)

    def after_step(self, trainer: Trainer) -> float:
        """Returns the seconds the trainer's thread spent publishing (with background_publish:
        taking the bytes and waiting for the previous version; the writes overlap the next step)."""
        t0 = time.perf_counter()
        with trainer.ev.span("publish"):
            blob = None if trainer.lora else trainer.weights_bytes()  # collective: every rank
        main = trainer.dist.is_main
        if checkpoint_due(trainer):
            if main:
                self.drain(trainer)  # every earlier version in the store before the checkpoint
            with trainer.ev.span("checkpoint"):
                trainer.save_checkpoint(blob, gathered=True)
            t0 = time.perf_counter()
        if not main:
            return 0.0
        version, eta = trainer.state.version, trainer.cfg.train.eta
        weights = trainer.adapter_files() if trainer.lora else blob  # read here: the next step changes the model

        def write() -> float:
            seconds = self.publish(trainer, weights, version)
            prune(trainer.store, version - max(8, 2 * eta + 2))
            return seconds

        def write_in_background() -> float:
            with trainer.ev.span("publish_background", state="background"):  # the helper's: apart (events.py)
                return write()

        in_flight = self.in_flight(trainer)
        with trainer.ev.span("publish"):  # the trainer's own: waiting for the previous write (or writing)
            seconds = in_flight.submit(write_in_background if in_flight.background else write)
        return seconds if seconds is not None else time.perf_counter() - t0

    def publish(self, trainer: Trainer, blob: bytes | dict[str, bytes] | None, version: int | None = None) -> float:
        """Publish `version` (default: the trainer's current one; rank 0): the full weights `blob`,
        or under LoRA the adapter files; and its `publish` event."""
        if version is None:
            version = trainer.state.version
        if blob is None and trainer.lora:
            blob = trainer.adapter_files()
        seconds = self.publisher.publish(version, blob)
        trainer.ev.emit("publish", version=version, bytes=self.publisher.last_weights_bytes, seconds=seconds)
        return seconds
