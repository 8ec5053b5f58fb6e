"""Online mode's admission: a serving proxy that writes sessions into a continuous run's root opens no
new session while (η + 1)·B·G of its rows wait for the trainer (`staleness.sessions_admissible`).

The proxy counts the rows it writes; the continuous trainer publishes the rows of each proxy it has
settled (trained, dropped, left out, duplicated or quarantined: `trainer/live_settled.json`,
online/live_sessions.py). A thread reads that file every `poll_s` (never the event loop: a slow
store stalls no request), and `check()` only compares two numbers. The bound is applied only while
the file exists and the run has no DONE: a run root whose trainer does not read live sessions, or
has finished, is not one to wait for. A damaged file (not JSON, nested past reason, over
`MAX_SETTLED_BYTES`) is logged and the last good count kept, and a count is never believed past the
rows this proxy wrote (a forged one can admit at most one bound more, until the trainer's next
write). Every open session holds max(1, its rows) of the bound (it writes at least one when it
ends), so sessions opened at once cannot all pass a bound of 8. A session writes at most
`max_session_rows` rows (C; proxy/manager.py), so waiting rows stay ≤ bound + (C − 1) × the sessions
open when the bound was reached, each of which held a row of it: ≤ C × bound. A stale read only
overstates what waits.
Sessions that are open go on: only a new session is refused
(`TrainerBehind`, saying how many rows wait; routes/errors.py answers it), so no request in flight and no turn of a live
session is lost. A restarted proxy counts the rows its shards already hold.
"""

from __future__ import annotations

import json
import logging
import threading

from areal_core.layout import LAYOUT
from areal_core.protocol import shard_rows
from areal_core.proxy.sessions import SessionProblem
from areal_core.staleness import sessions_admissible
from areal_core.store import Store

log = logging.getLogger("areal.proxy")

MAX_SETTLED_BYTES = 1 << 20  # live_settled.json: {"rows": {proxy: n}}, a few bytes per proxy


class TrainerBehind(SessionProblem):
    """A new session refused: the run's trainer has not yet settled enough of this proxy's rows."""

    def __init__(self, waiting: int, bound: int):
        super().__init__(
            f"the trainer is behind: {waiting} session rows of this proxy wait to be trained (bound {bound});"
            " retry the session later"
        )
        self.waiting, self.bound = waiting, bound


def parse_settled(record: object, worker_id: str) -> int:
    """The settled rows of `worker_id` in a live_settled.json record; ValueError for anything but
    {"rows": {worker: non-negative int}} (a float, a bool, a huge number written by someone else)."""
    rows = record.get("rows") if isinstance(record, dict) else None
    if not isinstance(rows, dict):
        raise ValueError(f"expected {{'rows': {{worker: count}}}}, got {str(record)[:100]}")
    value = rows.get(worker_id, 0)
    if type(value) is not int or not 0 <= value < 2**53:
        raise ValueError(f"rows of {worker_id!r} must be a non-negative integer, not {str(value)[:40]}")
    return value


class SessionAdmission:
    """`check()` before a new session: raises `TrainerBehind` while `bound` rows wait."""

    def __init__(
        self,
        store: Store,
        worker_id: str,
        bound: int,
        poll_s: float = 1.0,
        written: int | None = None,
        background: bool = True,
    ):
        if bound < 1:
            raise ValueError(f"the bound on waiting session rows must be >= 1, not {bound}")
        self.store, self.worker_id, self.bound, self.poll_s = store, worker_id, bound, poll_s
        self.written = count_written(store, worker_id) if written is None else written
        self.settled = 0
        self.active = False  # a continuous trainer publishes settled rows, and the run is not DONE
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="admission") if background else None
        if self._thread is not None:
            self._thread.start()

    def add_written(self, rows: int) -> None:
        self.written += rows

    def refresh(self) -> None:
        """Read the trainer's settled rows (the thread does, every poll_s); never raises."""
        try:
            if self.store.exists(LAYOUT.done):
                self.active = False
                return
            record = json.loads(self.store.read_bytes(LAYOUT.live_settled, MAX_SETTLED_BYTES))
        except FileNotFoundError:
            self.active = False
            return
        except (Exception, RecursionError) as exc:  # noqa: BLE001 - store out, not JSON, too big: the last count
            log.warning("%s unreadable (%s); admission keeps %d settled rows", LAYOUT.live_settled, exc, self.settled)
            return
        try:
            self.settled = min(parse_settled(record, self.worker_id), self.written)  # never past what we wrote
            self.active = True
        except ValueError as exc:
            log.warning("%s damaged (%s); admission keeps %d settled rows", LAYOUT.live_settled, exc, self.settled)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def waiting(self) -> int:
        return max(0, self.written - self.settled)

    def check(self, held_rows: int = 0) -> None:
        """Before a new session: the open sessions hold `held_rows` rows of the bound (each max(1, its
        rows): what it will write at least; `SessionManager.held_rows`)."""
        if not self.active:
            return
        if sessions_admissible(self.written + held_rows, self.settled, 0, self.bound) == 0:
            self.refused += 1
            raise TrainerBehind(self.waiting() + held_rows, self.bound)


def count_written(store: Store, worker_id: str) -> int:
    """Rows in the proxy's shards, graded and ungraded, a graded shard and its ungraded twin (the
    reward pool's graded copy of it) counted once."""
    graded = store.find(LAYOUT.shard_dir("graded", worker_id), ".arrow")
    twins = {LAYOUT.ungraded_twin(rel) for rel in graded}
    ungraded = [rel for rel in store.find(LAYOUT.shard_dir("ungraded", worker_id), ".arrow") if rel not in twins]
    return sum(shard_rows(store, rel) for rel in [*graded, *ungraded])


def admission_bound(eta: int, batch_rows: int) -> int:
    """(η + 1)·B·G rows, the most that may wait (`sessions_admissible` with nothing written)."""
    return sessions_admissible(0, 0, eta, batch_rows)
