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
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.store import Store
from areal_core.train.checkpoint import TrainerState
from areal_core.train.lineage import newest_published, resume_version
from areal_core.weights.faults import RepairPolicy, VersionCheck, VersionUnloadable, reports
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
    def __init__(self, publisher: WeightPublisher):
        self.publisher = publisher
        self.repair_policy = RepairPolicy()
        self._check: VersionCheck | None = None
        self._next_fault_check = 0.0

    def while_waiting(self, trainer: Trainer) -> None:
        """The readers' reports of the newest version (weights/faults.py), read at most every
        max(1 s, 10 rollout polls) after the last check ended: a version that fails its check is
        republished whole; one that cannot be repaired stops the run with the reason
        (VersionUnloadable on every rank). The check is advice: a store error in it is logged and
        the trainer goes on waiting."""
        decision: tuple[str, str] | None = None
        if trainer.dist.is_main and time.monotonic() >= self._next_fault_check:
            version, store = trainer.state.version, trainer.store
            if self._check is None:
                self._check = VersionCheck(store)
            try:
                decision = (self.repair_policy.decide(version, reports(store), self._check), "")
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
        with trainer.ev.span("publish"):
            blob = None if trainer.lora else trainer.weights_bytes()  # collective: every rank
        if checkpoint_due(trainer):
            with trainer.ev.span("checkpoint"):
                trainer.save_checkpoint(blob, gathered=True)
        if not trainer.dist.is_main:
            return 0.0
        with trainer.ev.span("publish"):
            seconds = self.publish(trainer, blob)
            prune(trainer.store, trainer.state.version - max(8, 2 * trainer.cfg.train.eta + 2))
        return seconds

    def publish(self, trainer: Trainer, blob: bytes | None) -> float:
        """Publish the trainer's current version (rank 0): the full weights `blob`, or under LoRA
        the adapter files; and its `publish` event."""
        version = trainer.state.version
        seconds = self.publisher.publish(version, trainer.adapter_files() if trainer.lora else blob)
        trainer.ev.emit("publish", version=version, bytes=self.publisher.last_weights_bytes, seconds=seconds)
        return seconds
