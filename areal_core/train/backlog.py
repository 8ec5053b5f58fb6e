"""The trainer's `backlog` event: how many shards wait on each side of the reward step."""

from __future__ import annotations

import time

from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.shard_feed import SUFFIX, ShardFeed
from areal_core.store import Store

BACKLOG_EVERY_S = 2.0


class BacklogRecorder:
    """Emits a `backlog` record at most every `every_s` seconds: ungraded shards without a graded
    twin the trainer has read or just found (the ungraded side listed from the graded feed's floor
    per worker: the cost is the backlog, not the run), graded shards not read yet, and groups
    waiting in the trainer's buffer."""

    def __init__(self, store: Store, events: EventLog, every_s: float = BACKLOG_EVERY_S):
        self.store, self.events, self.every_s = store, events, every_s
        self._at = -float("inf")

    def __call__(self, feed: ShardFeed, unread: list[str], buffered_groups: int) -> None:
        if time.monotonic() - self._at < self.every_s:
            return
        self._at = time.monotonic()
        found = set(unread)
        ungraded = 0
        for worker in self.store.listdir(LAYOUT.ungraded_dir):
            floor = feed.floor.get(worker)
            after = None if floor is None else LAYOUT.ungraded_shard(worker, floor)
            for p in self.store.find_after(LAYOUT.shard_dir("ungraded", worker), after, SUFFIX):
                twin = LAYOUT.graded_twin(p)
                ungraded += not (twin in found or feed.is_handled(twin))
        self.events.emit("backlog", ungraded=ungraded, graded=len(unread), buffered_groups=buffered_groups)
