"""Timing events of one role, appended to the store in batched parts, so that a report can be
rebuilt from the run root alone (a past run, a cluster run, a crashed run).

Each role process holds one `EventLog`. Records are kept in memory and written as one part file,
events/{role}-{id}/{seq:08d}.jsonl (`LAYOUT.events_part`), at most every `flush_every_s` seconds
and at `close()`: no per-token or per-sample I/O. A restarted role continues after its last part.

One JSON object per line. Every record has "t" (unix seconds, when it was recorded) and "kind":
  span       {"state": "busy"|"wait", "on": str, "t0": float, "t1": float}
             a stretch of work or of waiting, and on what: the trainer waits on "batch", rollout on
             "admission" or "weights", reward on "shards"; busy names a phase ("forward", "decode").
  phases     {"step": int, "phases": {name: seconds}}   where one step's time went (the profile):
             every span and every `add()` since the previous `end_step()`, summed by name.
  publish    {"version": int}                            the trainer published weights v
  load       {"version": int}                            a worker loaded weights v
  backlog    {"ungraded": int, "graded": int}            shards waiting
  trained    {"step": int, "samples": int, "staleness": {"s": count}, "dropped": int, "abandoned": int}
  drop       {"reason": str, "n": int}                   samples or groups dropped, and why
  quarantine {"path": str, "reason": str}
  sandbox    {"reason": str}                             a sandbox failure while grading
  count      {"completions": int, "tokens": int, "grades": int}   work done since the last count
  overhead   {"seconds": float}                          the event log's own time (written at close)
The record's role and worker are those of its part's folder; `read_events` adds them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.store import Store

FLUSH_EVERY_S = 2.0


class EventLog:
    """Batched timing records of one role process (`store` None: records are kept, never written)."""

    def __init__(self, store: Store | None, role: str, worker_id: str, flush_every_s: float = FLUSH_EVERY_S):
        self.store, self.role, self.worker_id = store, role, str(worker_id)
        self.flush_every_s = flush_every_s
        self._pending: list[str] = []
        self._phases: dict[str, float] = defaultdict(float)
        self._last_flush = time.monotonic()
        self.overhead_s = 0.0
        self._seq = self._next_seq()

    def _next_seq(self) -> int:
        if self.store is None:
            return 0
        folder = f"{LAYOUT.events_dir}/{self.role}-{self.worker_id}"
        seqs = [int(n.rsplit("/", 1)[-1][:-6]) for n in self.store.find(folder, ".jsonl")]
        return max(seqs, default=-1) + 1

    def emit(self, kind: str, **fields: Any) -> None:
        t0 = time.perf_counter()
        self._pending.append(json.dumps({"t": round(time.time(), 4), "kind": kind, **fields}, separators=(",", ":")))
        self.overhead_s += time.perf_counter() - t0
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    @contextlib.contextmanager
    def span(self, on: str, state: str = "busy") -> Iterator[None]:
        """Time the block as a `span` record and add its seconds to the phase `on`."""
        t0 = time.time()
        try:
            yield
        finally:
            t1 = time.time()
            self._phases[on] += t1 - t0
            self.emit("span", state=state, on=on, t0=round(t0, 4), t1=round(t1, 4))

    def add(self, phase: str, seconds: float) -> None:
        """Add seconds to a phase of the current step without a timeline record (inner loops)."""
        self._phases[phase] += seconds

    def end_step(self, step: int) -> dict[str, float]:
        """Close the current step: emit its `phases` record, start a new one; returns the phases."""
        phases = {k: round(v, 5) for k, v in self._phases.items()}
        self._phases.clear()
        self.emit("phases", step=step, phases=phases)
        return phases

    def flush(self) -> None:
        """Write the pending records as the next part file (no-op when there are none)."""
        t0 = time.perf_counter()
        self._last_flush = time.monotonic()
        if self._pending and self.store is not None:
            self.store.write_text(
                LAYOUT.events_part(self.role, self.worker_id, self._seq), "\n".join(self._pending) + "\n"
            )
            self._seq += 1
        if self.store is not None:
            self._pending = []
        self.overhead_s += time.perf_counter() - t0

    def close(self) -> None:
        self._pending.append(json.dumps({"t": round(time.time(), 4), "kind": "overhead", "seconds": self.overhead_s}))
        self.flush()


def read_events(store: Store) -> list[dict[str, Any]]:
    """Every record of every role in the run root, with "role" and "worker" added, sorted by "t".
    A truncated line (a part cut by a crash mid-write cannot happen on the store, but a hand-copied
    root may have one) is skipped."""
    out: list[dict[str, Any]] = []
    for rel in store.find(LAYOUT.events_dir, ".jsonl"):
        role, _, worker = rel.rsplit("/", 2)[-2].partition("-")
        for line in store.read_text(rel).splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            rec["role"], rec["worker"] = role, worker
            out.append(rec)
    out.sort(key=lambda r: r["t"])
    return out
