"""Series for the report, from the events (areal_core/events.py), the trainer's metrics rows
(trainer/metrics.jsonl) and its audit records (trainer/trained/step-N.json): pure functions.

Times are seconds since the run's first record. A step's time is that of its `trained` event,
else of the `publish` of version = step (the trainer publishes v = step after step v).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from areal_core.report.timing import length, union, worker_spans, worker_windows

Records = list[dict[str, Any]]
Rows = Sequence[dict[str, Any]]


def kinds(records: Records, *names: str) -> Records:
    return [r for r in records if r.get("kind") in names]


def engine_choices(records: Records) -> list[str]:
    """The rollout engines of the run, one line per distinct (setting, engine, why) of the workers'
    `engine` events: "continuous (rollout.engine=auto: why)", with the workers that chose it."""
    workers: dict[tuple[str, str, str], list[str]] = {}
    for r in kinds(records, "engine"):
        key = (str(r.get("engine", "?")), str(r.get("setting", "?")), str(r.get("why", ""))[:300])
        workers.setdefault(key, []).append(f"{r.get('role', 'rollout')}-{r.get('worker', '?')}")
    return [f"{e} (rollout.engine={s}: {why}; {', '.join(sorted(set(w)))})" for (e, s, why), w in workers.items()]


def trained(records: Records) -> Records:
    """The `trained` records, one per step: the last (by "t") of each, as a trainer resumed from
    a checkpoint trains the steps after it again and records them again (events.py)."""
    last = {int(r["step"]): r for r in sorted(kinds(records, "trained"), key=lambda r: r["t"]) if "step" in r}
    return [last[s] for s in sorted(last)]


def run_start(records: Records) -> float:
    """The run's t = 0: the earliest start of any record (a span's t0 counts)."""
    return min((float(r.get("t0", r["t"])) for r in records), default=0.0)


def step_times(records: Records) -> dict[int, float]:
    """step -> unix time it ended: the `trained` event, else the `publish` of that version."""
    out = {int(r["version"]): float(r["t"]) for r in kinds(records, "publish") if "version" in r}
    out.update({int(r["step"]) + 1: float(r["t"]) for r in kinds(records, "trained") if "step" in r})
    return out


def metric_series(rows: Rows, name: str, times: dict[int, float], t0: float) -> dict[str, list[float]]:
    """{"step", "value"} of one metric, and {"t", "t_value"}: seconds since t0 and the value, for
    the steps with a known time."""
    pts = [(int(r["step"]), float(r[name])) for r in rows if name in r and r[name] is not None]
    return {
        "step": [s for s, _ in pts],
        "value": [v for _, v in pts],
        "t": [times[s] - t0 for s, _ in pts if s in times],
        "t_value": [v for s, v in pts if s in times],
    }


def timeline(records: Records, t0: float, resolution_s: float = 0.0) -> dict[str, dict[str, list[tuple]]]:
    """ "role-worker" -> {"busy" | "wait:<on>": [(start, duration)]} in seconds since t0, with
    intervals closer than `resolution_s` joined (one plot pixel); a worker's helper-thread work
    ("background:<on>", events.py) in a lane of its own, "role-worker helper", under it."""
    out: dict[str, dict[str, list[tuple]]] = {}
    for (role, worker), labels in sorted(worker_spans(records).items()):
        for lane, own in ((f"{role}-{worker}", False), (f"{role}-{worker} helper", True)):
            bars = {
                label: [(a - t0, b - a) for a, b in union(ivs, resolution_s)]
                for label, ivs in sorted(labels.items())
                if label.startswith("background:") == own
            }
            if bars:
                out[lane] = bars
    return out


def staleness(records: Records, audits: Rows) -> tuple[dict[int, int], list[tuple[int, float]]]:
    """(histogram {staleness: trained tokens}, trend [(step, mean staleness)]) from the `trained`
    events, else from the audit records' staleness_histogram (both count policy tokens). Steps are
    numbered as in the metrics rows: the audit's step s is the metrics' step s + 1."""
    src = [(int(r["step"]), r.get("staleness") or {}) for r in trained(records)]
    if not src:
        src = [(int(a["step"]), a.get("staleness_histogram") or {}) for a in audits if "step" in a]
    hist: Counter[int] = Counter()
    trend = []
    for step, h in sorted(src, key=lambda x: x[0]):
        counts = {int(k): int(v) for k, v in h.items()}
        hist.update(counts)
        n = sum(counts.values())
        if n:
            trend.append((step + 1, sum(k * v for k, v in counts.items()) / n))
    return dict(sorted(hist.items())), trend


def backlog(records: Records, t0: float) -> dict[str, list[float]]:
    """{"t", "ungraded", "graded"}: shards waiting, over time."""
    recs = kinds(records, "backlog")
    return {
        "t": [float(r["t"]) - t0 for r in recs],
        "ungraded": [int(r.get("ungraded", 0)) for r in recs],
        "graded": [int(r.get("graded", 0)) for r in recs],
    }


def publish_lag(records: Records) -> dict[str, list[tuple[int, float]]]:
    """worker -> [(version, seconds from the start of the trainer's publish of v (its record's t
    less its "seconds") to this worker's `load` of v)]: writing, noticing and loading the weights.
    A version published again (a trainer resumed from its checkpoint) counts each load from the
    latest publish of v that began before it (the first, when none did: clock skew)."""
    published: dict[int, list[float]] = defaultdict(list)
    for r in kinds(records, "publish"):
        published[int(r["version"])].append(float(r["t"]) - float(r.get("seconds", 0.0)))
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in kinds(records, "load"):
        v, t = int(r["version"]), float(r["t"])
        starts = published.get(v)
        if starts:  # none before the load: clocks of two machines a little apart; the first publish
            before = [s for s in starts if s <= t]
            out[f"{r['role']}-{r['worker']}"].append((v, t - (max(before) if before else min(starts))))
    return {k: sorted(v) for k, v in sorted(out.items())}


COUNTED = ("completions", "tokens", "grades")


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Per role: totals, the mean rate over the role's active window, and binned rates."""

    totals: dict[str, dict[str, int]]  # role -> {completions|tokens|grades: n}
    rates: dict[str, dict[str, float]]  # role -> {...: n / seconds the role was up}
    binned: dict[str, dict[str, tuple[list[float], list[float]]]]  # role -> key -> (bin centres, per s)


def throughput(records: Records, t0: float, bins: int = 40, min_bin_s: float = 5.0) -> Throughput:
    """Counts from the `count` events: total, total / the seconds any worker of the role was up
    (report/timing.py: its records' stretches, long silences left out), and the
    rate in at most `bins` equal time bins over the run, each at least `min_bin_s` long (a role
    counts once per flush, every 2 s: narrower bins would be spikes and gaps)."""
    counts = kinds(records, "count")
    end = max((float(r["t"]) for r in records), default=t0)
    width = max((end - t0) / bins, min_bin_s)
    bins = max(1, min(bins, int((end - t0) / width) + 1))
    up: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (role, _), ivs in worker_windows(records).items():
        up[role] += ivs
    active = {role: length(union(ivs)) for role, ivs in up.items()}
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    hist: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * bins))
    for r in counts:
        i = min(bins - 1, int((float(r["t"]) - t0) / width))
        for key in COUNTED:
            if r.get(key):
                totals[r["role"]][key] += int(r[key])
                hist[r["role"]][key][i] += int(r[key]) / width
    centres = [t0 + (i + 0.5) * width - t0 for i in range(bins)]
    rates = {role: {k: n / max(active[role], 1e-9) for k, n in keys.items()} for role, keys in totals.items()}
    return Throughput(
        totals={r: dict(k) for r, k in totals.items()},
        rates=rates,
        binned={r: {k: (centres, v) for k, v in keys.items()} for r, keys in hist.items()},
    )


AUDITED_DROPS = {"stale": "dropped", "abandoned_version": "abandoned"}  # reason -> `trained` field


def reasons(records: Records) -> dict[str, dict[str, int]]:
    """{"drop": {reason: samples}, "quarantine": {reason: shards}, "sandbox": {reason: failures},
    "checkpoint_skipped": {reason: checkpoints}}.
    Once the trainer has trained a step, its "stale" and "abandoned_version" counts are those of
    its audit (the `trained` records, last per step), as in `totals`: its `drop` events repeat
    when a resumed trainer trains a step again."""
    out: dict[str, Counter[str]] = {k: Counter() for k in ("drop", "quarantine", "sandbox", "checkpoint_skipped")}
    audited = trained(records)
    for r in kinds(records, "drop"):
        if audited and r["role"] == "trainer" and r.get("reason") in AUDITED_DROPS:
            continue
        out["drop"][str(r.get("reason", "?"))] += int(r.get("n", 1))
    for r in audited:
        for reason, key in AUDITED_DROPS.items():
            out["drop"][reason] += int(r.get(key, 0))
    for kind in ("quarantine", "sandbox", "checkpoint_skipped"):
        for r in kinds(records, kind):
            out[kind][str(r.get("reason", "?"))[:120]] += 1
    return {k: {r: n for r, n in v.most_common() if n} for k, v in out.items()}


MISMATCH = ("kl_behav_prox", "importance_weight_min", "importance_weight_mean", "importance_weight_max")


def mismatch(rows: Rows) -> dict[str, list[float]]:
    """{"step", "kl_behav_prox", "importance_weight_{min,mean,max}", "abs_dlogp_behav_prox"} per
    trained step: how far the behaviour policy was from the proximal one (train/loss/decoupled_ppo.py
    logs them)."""
    rows = [r for r in rows if all(r.get(k) is not None for k in MISMATCH)]
    out = {"step": [int(r["step"]) for r in rows], **{k: [float(r[k]) for r in rows] for k in MISMATCH}}
    # mean |log π_behav − log π_prox| per token: the engine/trainer gap (dtype, kernels) plus staleness
    out["abs_dlogp_behav_prox"] = [float(r.get("abs_dlogp_behav_prox") or 0.0) for r in rows]
    return out


@dataclasses.dataclass(frozen=True)
class Totals:
    """What the run did, counted from the events (audit records where the events are silent)."""

    steps: int
    trained_samples: int
    dropped_samples: int
    abandoned_samples: int
    staleness: dict[int, int]
    wall_s: float


def totals(records: Records, rows: Rows, audits: Rows) -> Totals:
    last = trained(records)
    hist, _ = staleness(records, audits)
    if last:
        steps = len(last)
        samples = sum(int(r.get("samples", 0)) for r in last)
        dropped = sum(int(r.get("dropped", 0)) for r in last)
        abandoned = sum(int(r.get("abandoned", 0)) for r in last)
    else:
        steps = len(audits)
        samples = sum(len(a.get("samples", [])) for a in audits)
        dropped = sum(len(a.get("dropped", [])) for a in audits)
        abandoned = sum(len(a.get("abandoned", [])) for a in audits)
    t0 = run_start(records)
    wall = max((float(r["t"]) for r in records), default=t0) - t0
    return Totals(steps, samples, dropped, abandoned, hist, wall)


def step_metrics(records: Records, rows: Rows) -> dict[int, dict[str, float]]:
    """The per-step series logged to MLflow as `report/...`: for each trained step,
    trainer_wait_frac (the step's "batch" wait / all its phase seconds, from `phases`),
    backlog_ungraded / backlog_graded (the last backlog record before the step ended),
    publish_lag_s (mean load - publish of version = step over the workers that loaded it),
    staleness_mean (from the step's `trained` event)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for r in kinds(records, "phases"):
        if r["role"] == "trainer" and r.get("phases"):
            total = sum(float(v) for v in r["phases"].values())
            if total > 0:
                out[int(r["step"])]["trainer_wait_frac"] = float(r["phases"].get("batch", 0.0)) / total
    ends = step_times(records)
    marks = sorted(
        (float(r["t"]), int(r.get("ungraded", 0)), int(r.get("graded", 0))) for r in kinds(records, "backlog")
    )
    j, last = 0, None
    for step in sorted(ends):
        while j < len(marks) and marks[j][0] <= ends[step]:
            last, j = marks[j], j + 1
        if last is not None:
            out[step]["backlog_ungraded"], out[step]["backlog_graded"] = float(last[1]), float(last[2])
    lags: dict[int, list[float]] = defaultdict(list)
    for pts in publish_lag(records).values():
        for v, lag in pts:
            lags[v].append(lag)
    for v, ls in lags.items():
        out[v]["publish_lag_s"] = sum(ls) / len(ls)
    for step, mean in staleness(records, [])[1]:
        out[step]["staleness_mean"] = mean
    return {s: out[s] for s in sorted(out)}
