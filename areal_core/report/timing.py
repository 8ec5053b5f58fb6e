"""Where each role's time went, from the `span` events (areal_core/events.py): pure functions.

A worker's window is the time it was up: the union of its records' stretches (a span from its
t0 to its t1, any other record at its t) with the gaps under `IDLE_GAP_S` filled; a longer
silence (a crashed worker's downtime before a retried attempt) is no one's time. Its wait
fraction on `on` is |∪ wait spans on `on`| / |window|, its busy fraction |∪ busy spans| / |window|
(nested busy phases count once); a role's fraction is the mean over its workers. Time neither
busy nor waiting (setup, untimed work) counts as neither. A "background" span (a helper thread's
work beside the worker's own timeline: the trainer's "publish_background", train.background_publish)
counts as neither too, so busy + waiting stays within the window; its share is reported apart
(`RoleTime.background_on`), and may overlap both.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]
IDLE_GAP_S = 60.0  # a live role records at least every few seconds (events.py: switch, flush)


def union(intervals: Iterable[Interval], gap: float = 0.0) -> list[Interval]:
    """Sorted disjoint intervals covering the input; intervals closer than `gap` are joined
    (a plot's resolution)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b < a:
            continue
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def record_start(rec: dict[str, Any]) -> float:
    return float(rec["t0"]) if rec.get("kind") == "span" and "t0" in rec else float(rec["t"])


def worker_windows(records: Iterable[dict[str, Any]], gap: float = IDLE_GAP_S) -> dict[tuple[str, str], list[Interval]]:
    """(role, worker) -> the stretches it was up: its records' [start, t], gaps under `gap` joined."""
    out: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    for rec in records:
        out[(rec["role"], rec["worker"])].append((record_start(rec), float(rec["t"])))
    return {k: union(v, gap) for k, v in out.items()}


def span_label(rec: dict[str, Any]) -> str:
    """ "busy", "background:<on>" (a helper thread's work) or "wait:<on>"."""
    state = rec.get("state")
    if state == "busy":
        return "busy"
    return f"{'background' if state == 'background' else 'wait'}:{rec.get('on', '?')}"


def worker_spans(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[Interval]]]:
    """(role, worker) -> {"busy": [...], "wait:<on>": [...], "background:<on>": [...]}: raw intervals
    of every span."""
    out: dict[tuple[str, str], dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if rec.get("kind") != "span":
            continue
        label = span_label(rec)
        out[(rec["role"], rec["worker"])][label].append((float(rec["t0"]), float(rec["t1"])))
    return out


@dataclasses.dataclass(frozen=True)
class RoleTime:
    """One role's share of time, averaged over its workers (fractions of each worker's window)."""

    role: str
    workers: int
    window_s: float  # the mean worker window (seconds up)
    busy: float
    wait: float  # any wait
    wait_on: dict[str, float]  # wait fraction per cause ("batch", "admission", "shards", ...)
    background_on: dict[str, float] = dataclasses.field(default_factory=dict)  # helper threads' work, apart

    @property
    def main_wait(self) -> str:
        return max(self.wait_on, key=self.wait_on.get) if self.wait_on else ""


def role_time(records: list[dict[str, Any]], since: float | None = None) -> dict[str, RoleTime]:
    """Per role, busy and wait fractions over each worker's window (from `since` when given);
    roles with no span at all are left out."""
    windows = worker_windows(records)
    spans = worker_spans(records)
    per_role: dict[str, list[tuple[float, float, float, dict[str, float], dict[str, float]]]] = defaultdict(list)
    for key, labels in spans.items():
        up = clip(windows[key], since if since is not None else -float("inf"), float("inf"))
        window = length(up)
        if window <= 0:
            continue

        def share(ivs: Iterable[Interval], up: list[Interval] = up) -> float:
            merged = union(ivs)
            return sum(length(clip(merged, a, b)) for a, b in up)

        busy = share(labels.get("busy", []))
        waits = {k: v for k, v in labels.items() if k.startswith("wait:")}
        wait_all = share(iv for v in waits.values() for iv in v)
        wait_on = {k[5:]: share(v) / window for k, v in waits.items()}
        background = {k[11:]: share(v) / window for k, v in labels.items() if k.startswith("background:")}
        per_role[key[0]].append((window, busy / window, wait_all / window, wait_on, background))
    out = {}
    for role, rows in per_role.items():
        n = len(rows)
        causes = {c for r in rows for c in r[3]}
        out[role] = RoleTime(
            role=role,
            workers=n,
            window_s=sum(r[0] for r in rows) / n,
            busy=min(1.0, sum(r[1] for r in rows) / n),
            wait=min(1.0, sum(r[2] for r in rows) / n),
            wait_on={c: sum(r[3].get(c, 0.0) for r in rows) / n for c in sorted(causes)},
            background_on={b: sum(r[4].get(b, 0.0) for r in rows) / n for b in sorted({b for r in rows for b in r[4]})},
        )
    return out
