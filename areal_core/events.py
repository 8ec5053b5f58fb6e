"""Timing events of one role, appended to the store in batched parts, so that a report can be
rebuilt from the run root alone (a past run, a cluster run, a crashed run).

Each role process holds one `EventLog`. Records are kept in memory and written as one part file,
events/{role}-{id}/{seq:08d}.jsonl (`LAYOUT.events_part`), by a background thread every
`flush_every_s` seconds (when there is anything new) and at `close()`: no per-token or per-sample
I/O on the role's own thread, and a crashed (SIGKILLed) role loses at most the last
`flush_every_s` seconds of records. A part that cannot be written (store outage) is kept and
written with the next one. A restarted role continues after its last part. Thread-safe: a
role's helper threads (a weight watcher) record into the same log.

One JSON object per line. Every record has "t" (unix seconds, when it was recorded) and "kind":
  span       {"state": "busy"|"wait"|"background", "on": str, "t0": float, "t1": float}
             a stretch of work or of waiting, and on what: the trainer waits on "batch", rollout on
             "admission" or "weights", reward on "shards"; busy names a phase ("forward", "decode").
             Spans of one worker may nest (rollout's "shard_write" inside "generate", which covers
             the groups in flight); a long stretch comes as consecutive pieces (`switch`).
             Trainer busy: "read", "batch_build", "train", "checkpoint", "publish" (on its own
             thread: taking the bytes, waiting for the previous version's write), "eval",
             "metrics"; rollout busy: "generate", "shard_write"; reward busy: "grade", "io".
             "background": a helper thread's work beside the role's own timeline, which may
             overlap its busy and its waiting (the trainer's "publish_background": a version's
             store writes under train.background_publish); the report shows it apart, counted
             as neither busy nor waiting (report/timing.py).
  phases     {"step": int, "phases": {name: seconds}}   where one step's time went (the profile):
             every span and every `add()` since the previous `end_step()`, summed by name; the
             trainer's "train" also splits into "forward", "backward", "optimizer" (train/step.py).
  publish    {"version": int, "bytes": int, "seconds": float}   the trainer published weights v
  load       {"version": int, "seconds": float}          a worker loaded weights v (took seconds)
  engine     {"setting": str, "engine": str, "why": str}  a rollout worker's engine, once at its start:
             rollout.engine as set, the engine that runs, and why (rollout/engine_choice.py)
  backlog    {"ungraded": int, "graded": int, "buffered_groups": int}   shards waiting: ungraded
             shards without a graded twin, graded shards the trainer has not read yet, and groups
             read into the trainer's buffer not trained yet (trainer, at most every 2 s)
  trained    {"step": int, "samples": int, "staleness": {"s": count}, "dropped": int, "abandoned": int}
             one per step, the same numbers as the audit record trainer/trained/step-{step}.json
             (its drops include those made while waiting for the batch; "step" is the audit's
             step, 0-based, as is the `phases` record's). A trainer restarted from a checkpoint
             trains the steps after it again: the last record of a step is the one that counts
  drop       {"reason": str, "n": int}                   samples dropped, and why. Trainer: "stale"
             (older than v − η; their sum is the counter dropped_samples), "abandoned_version",
             "duplicate", "uninformative" (+ "groups"), "reward_skipped" (every reward function
             returned None, TRL's "not applicable"; their sum is the counter skipped_samples);
             rollout: "engine_failed", "empty_group", and a bad prompt record's "bad_image" /
             "bad_prompt" (+ "group", "prompt_id", "error"),
             with "unit": "groups" (n counts groups; without "unit", n counts samples)
  quarantine {"path": str, "reason": str}                a shard moved to quarantine/ (any role)
  sandbox    {"reason": str, "n": int}                   sandbox failures while grading, per reason
  checkpoint_skipped {"step": int, "reason": str}       a committed checkpoint that failed verification
             (or did not load) passed over for an older one when the trainer started
  promotion  {"version": int, "score": float, "promoted": bool}   continuous mode's gate (online/promotion.py):
             the version's held-out score, and whether the registry's champion moved to it
  count      {"completions": int, "tokens": int, "grades": int}   work done since the last count
             (any subset of the keys, summed per flush: never one record per sample); tokens are
             the policy's generated tokens (loss-mask ones)
  overhead   {"seconds": float, "wall_s": float}         the event log's own time, at close: the
             role's threads inside `emit`/`count`/`close`, plus the CPU time of the flusher thread
             (its waits on the store's I/O block nobody); wall_s: seconds the log was open
The record's role and worker are those of its part's folder; `read_events` adds them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.store import Store

FLUSH_EVERY_S = 2.0
log = logging.getLogger("areal.events")


class EventLog:
    """Batched timing records of one role process (`store` None: records are kept, never written)."""

    def __init__(self, store: Store | None, role: str, worker_id: str, flush_every_s: float = FLUSH_EVERY_S):
        if "-" in role or "/" in role or "/" in str(worker_id):
            raise ValueError(f"event log role {role!r} / worker {worker_id!r}: no '-' in a role, no '/' in either")
        self.store, self.role, self.worker_id = store, role, str(worker_id)
        self.flush_every_s = flush_every_s
        self._pending: list[str] = []
        self._counts: dict[str, int] = defaultdict(int)
        self._phases: dict[str, float] = defaultdict(float)
        self._stretch: tuple[str, str, float] | None = None  # (on, state, since) of `switch`
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one part written at a time, in order
        self.overhead_s = 0.0
        self._opened = time.perf_counter()
        self._warned = False
        self._seq = self._next_seq()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and flush_every_s > 0:
            self._thread = threading.Thread(target=self._flusher, name=f"events-{role}", daemon=True)
            self._thread.start()

    def _next_seq(self) -> int:
        if self.store is None:
            return 0
        folder = f"{LAYOUT.events_dir}/{self.role}-{self.worker_id}"
        seqs = [int(n.rsplit("/", 1)[-1][:-6]) for n in self.store.find(folder, ".jsonl")]
        return max(seqs, default=-1) + 1

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self.flush()

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event now (kept in memory; written by the next flush)."""
        t0 = time.perf_counter()
        line = json.dumps({"t": round(time.time(), 4), "kind": kind, **fields}, separators=(",", ":"))
        with self._lock:
            self._pending.append(line)
            self.overhead_s += time.perf_counter() - t0

    def count(self, **n: int) -> None:
        """Add to the work counters (completions, tokens, grades); one `count` record per flush."""
        t0 = time.perf_counter()
        with self._lock:
            for key, value in n.items():
                self._counts[key] += value
            self.overhead_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def span(self, on: str, state: str = "busy") -> Iterator[None]:
        """Time the block as a `span` record and add its seconds to the phase `on`."""
        t0 = time.time()
        try:
            yield
        finally:
            self.record_span(on, t0, time.time(), state)

    def record_span(self, on: str, t0: float, t1: float, state: str = "busy") -> None:
        """A `span` record of a stretch timed by the caller (unix seconds), added to the phase `on`."""
        self.add(on, t1 - t0)
        self.emit("span", state=state, on=on, t0=round(t0, 4), t1=round(t1, 4))

    def switch(self, on: str | None, state: str = "busy", at: float | None = None) -> None:
        """A role's continuous timeline: end the current stretch (as a `span` record) and start one
        on `on` (None: neither busy nor waiting), at `at` (unix seconds; default now). Called again
        with the same `on` and `state` it continues, but a stretch is recorded in pieces of at most
        `flush_every_s` seconds, so a long wait shows before it ends. Cheap enough for every poll."""
        now = time.time() if at is None else at
        current = self._stretch
        if current is not None and current[:2] == (on, state) and now - current[2] < max(self.flush_every_s, 0.5):
            return
        if current is not None:
            self.record_span(current[0], current[2], now, current[1])
        self._stretch = None if on is None else (on, state, now)

    def add(self, phase: str, seconds: float) -> None:
        """Add seconds to a phase of the current step without a timeline record (inner loops). Under
        the lock: a helper thread's span (train.background_publish) may land while `end_step` reads."""
        with self._lock:
            self._phases[phase] += seconds

    def end_step(self, step: int) -> dict[str, float]:
        """Close the current step: emit its `phases` record, start a new one; returns the phases."""
        with self._lock:
            phases = {k: round(v, 5) for k, v in self._phases.items()}
            self._phases.clear()
        self.emit("phases", step=step, phases=phases)
        return phases

    def _take(self) -> list[str]:
        with self._lock:
            if self._counts:
                counts = {k: v for k, v in self._counts.items() if v}
                self._counts.clear()
                if counts:
                    rec = {"t": round(time.time(), 4), "kind": "count", **counts}
                    self._pending.append(json.dumps(rec, separators=(",", ":")))
            if self.store is None:
                return []
            lines, self._pending = self._pending, []
            return lines

    def flush(self) -> None:
        """Write the pending records as the next part file (no-op when there are none). A part the
        store refuses is put back in front of the pending records and tried again next time."""
        clock = time.thread_time if threading.current_thread() is self._thread else time.perf_counter
        t0 = clock()
        with self._write_lock:
            lines = self._take()
            if lines:
                try:
                    self.store.write_text(
                        LAYOUT.events_part(self.role, self.worker_id, self._seq), "\n".join(lines) + "\n"
                    )
                    self._seq += 1
                except Exception as exc:  # noqa: BLE001 - timing records never stop a role
                    with self._lock:
                        self._pending[:0] = lines
                    if not self._warned:
                        log.warning(
                            "events of %s-%s not written yet (kept, retried): %s", self.role, self.worker_id, exc
                        )
                        self._warned = True
        with self._lock:
            self.overhead_s += clock() - t0

    def close(self) -> None:
        """End the current stretch, stop the flusher, record the log's own overhead and write what
        is left. A second call does nothing."""
        if self._stop.is_set():
            return
        self.switch(None)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self.emit("overhead", seconds=round(self.overhead_s, 6), wall_s=round(time.perf_counter() - self._opened, 3))
        self.flush()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(store: Store) -> list[dict[str, Any]]:
    """Every record of every role in the run root, with "role" and "worker" added, sorted by "t".
    A truncated line (a part cut by a crash mid-write cannot happen on the store, but a hand-copied
    root may have one) is skipped."""
    return EventTail(store).new()


class EventTail:
    """A live view of a running root's events: each `new()` returns the records of the parts not
    read before (a part is written once, whole), sorted by "t". One listing per call."""

    def __init__(self, store: Store):
        self.store = store
        self._read: set[str] = set()

    def new(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fresh = [rel for rel in self.store.find(LAYOUT.events_dir, ".jsonl") if rel not in self._read]
        for rel in fresh:  # a store error on the way leaves every part of this call unread
            role, _, worker = rel.rsplit("/", 2)[-2].partition("-")
            for line in self.store.read_text(rel).splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get("t"), (int, float)) or "kind" not in rec:
                    continue
                rec["role"], rec["worker"] = role, worker
                out.append(rec)
        self._read.update(fresh)
        out.sort(key=lambda r: r["t"])
        return out
