"""The trainer's `backlog` event: how many shards wait on each side of the reward step."""

from __future__ import annotations

import time

from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.store import Store

BACKLOG_EVERY_S = 2.0


class BacklogRecorder:
    """Emits a `backlog` record at most every `every_s` seconds, from the graded listing the
    trainer already made: ungraded shards without a graded twin (the one extra listing, of the
    ungraded side), graded shards not read yet, and groups waiting in the trainer's buffer."""

    def __init__(self, store: Store, events: EventLog, every_s: float = BACKLOG_EVERY_S):
        self.store, self.events, self.every_s = store, events, every_s
        self._at = -float("inf")

    def __call__(self, graded: list[str], unread: int, buffered_groups: int) -> None:
        if time.monotonic() - self._at < self.every_s:
            return
        self._at = time.monotonic()
        twins = {LAYOUT.ungraded_twin(p) for p in graded}
        ungraded = sum(1 for p in self.store.find(LAYOUT.ungraded_dir, ".arrow") if p not in twins)
        self.events.emit("backlog", ungraded=ungraded, graded=unread, buffered_groups=buffered_groups)
