"""Online mode's admission: a serving proxy that writes sessions into a run root opens no new session
while (η + 1)·B·G of its rows wait for the trainer (`staleness.sessions_admissible`).

The proxy counts the rows it writes; the trainer publishes the rows of each proxy it has settled
(trained, dropped or left out: `trainer/live_settled.json`, online/live_sessions.py), read here at
most every `poll_s`. A stale read only overstates what waits, so the bound is never exceeded by more
than the rows of the sessions already open when it is reached. Sessions that are open go on: only a
new session is refused (`TrainerBehind`, a 429 saying how many rows wait), so no request in flight
and no turn of a live session is lost. A restarted proxy counts the rows its shards already hold.
"""

from __future__ import annotations

import logging
import time

from areal_core.ipc_reader import IpcError, read_ipc_file
from areal_core.layout import LAYOUT
from areal_core.protocol import DEFAULT_LIMITS
from areal_core.proxy.sessions import SessionProblem
from areal_core.staleness import sessions_admissible
from areal_core.store import Store

log = logging.getLogger("areal.proxy")


class TrainerBehind(SessionProblem):
    """A new session refused: the run's trainer has not yet settled enough of this proxy's rows."""

    def __init__(self, waiting: int, bound: int):
        super().__init__(
            f"the trainer is behind: {waiting} session rows of this proxy wait to be trained (bound {bound});"
            " retry the session later"
        )
        self.waiting, self.bound = waiting, bound


class SessionAdmission:
    """`check()` before a new session: raises `TrainerBehind` while `bound` rows wait."""

    def __init__(self, store: Store, worker_id: str, bound: int, poll_s: float = 1.0, written: int | None = None):
        if bound < 1:
            raise ValueError(f"the bound on waiting session rows must be >= 1, not {bound}")
        self.store, self.worker_id, self.bound, self.poll_s = store, worker_id, bound, poll_s
        self.written = count_written(store, worker_id) if written is None else written
        self.settled = 0
        self.refused = 0
        self._read_at = -float("inf")

    def add_written(self, rows: int) -> None:
        self.written += rows

    def _refresh(self) -> None:
        if time.monotonic() - self._read_at < self.poll_s:
            return
        self._read_at = time.monotonic()
        try:
            rows = self.store.read_json(LAYOUT.live_settled)["rows"]
            self.settled = max(self.settled, int(rows.get(self.worker_id, 0)))
        except FileNotFoundError:
            return
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a damaged file: keep the last count
            log.warning("%s unreadable (%s); admission keeps %d settled rows", LAYOUT.live_settled, exc, self.settled)

    def waiting(self) -> int:
        self._refresh()
        return max(0, self.written - self.settled)

    def check(self) -> None:
        waiting = self.waiting()
        if waiting >= self.bound:
            self.refused += 1
            raise TrainerBehind(waiting, self.bound)


def count_written(store: Store, worker_id: str) -> int:
    """Rows in the proxy's shards, graded and ungraded, where a graded shard has an ungraded twin
    only once (the reward pool writes the graded copy under the same name)."""
    names: dict[str, str] = {}
    for stage in ("ungraded", "graded"):
        for rel in store.find(LAYOUT.shard_dir(stage, worker_id), ".arrow"):
            names[rel.rsplit("/", 1)[-1]] = rel
    return sum(shard_rows(store, rel) for rel in names.values())


def shard_rows(store: Store, rel: str) -> int:
    """The rows of one shard, read as the trainer reads it (bounded); 0 for one that does not parse
    (the trainer quarantines it, and it holds no row that can wait)."""
    try:
        data = store.read_bytes(rel)
        if len(data) > DEFAULT_LIMITS.max_bytes:
            return 0
        return read_ipc_file(data, DEFAULT_LIMITS.max_rows).num_rows
    except (FileNotFoundError, IpcError):
        return 0


def admission_bound(eta: int, batch_rows: int) -> int:
    """(η + 1)·B·G rows, the most that may wait (`sessions_admissible` with nothing written)."""
    return sessions_admissible(0, 0, eta, batch_rows)
