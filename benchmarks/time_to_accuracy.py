"""Time to held-out accuracy, ours at each η against TRL, from runs already made (issue 27).

    PYTHONPATH=. .venv/bin/python benchmarks/time_to_accuracy.py --ours runs/async-800/results.jsonl \\
        --trl runs/async-800/trl.log [--thresholds 0.5 0.55 0.6]

`--ours`: `benchmarks/staleness_ablation.py`'s results.jsonl (per cell: `curve` {step: accuracy}
and `clock` {step: trainer seconds to that step, the evaluations taken out}). `--trl`: the stdout
of `benchmarks/vs_trl.py --systems trl` (its `RESULT {...}` lines: `curve` and `wall_s`, the RL
phase without the snapshot evaluations; a step's time is step × wall_s / last step, TRL's steps
taking equal time). Per system: final accuracy (mean ± sd over seeds), the mean curve, and for
each threshold the steps and seconds to the first evaluation at or above it, as the mean over
the seeds that reached it ("k/n": how many did).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def first_at(curve: dict[int, float], clock: dict[int, float], threshold: float) -> tuple[int, float] | None:
    """(step, seconds) of the first evaluation at or above `threshold`; None if none is."""
    for step in sorted(curve):
        if curve[step] >= threshold:
            return step, clock[step]
    return None


def load_ours(path: str) -> dict[str, list[tuple[dict[int, float], dict[int, float]]]]:
    runs: dict[str, list] = defaultdict(list)
    for line in open(path):
        r = json.loads(line) if line.strip() else None
        if not r or "curve" not in r:
            continue
        curve = {int(k): float(v) for k, v in r["curve"].items()}
        clock = {int(k): float(v) for k, v in r["clock"].items()}
        runs[f"ours, η = {r['eta']}"].append((curve, clock))
    return runs


def load_trl(path: str) -> dict[str, list[tuple[dict[int, float], dict[int, float]]]]:
    runs: dict[str, list] = defaultdict(list)
    for line in open(path):
        if not line.startswith("RESULT "):
            continue
        r = json.loads(line[len("RESULT ") :])
        if r.get("system") != "trl":
            continue
        curve = {int(k): float(v) for k, v in r["curve"].items()}
        per_step = float(r["wall_s"]) / max(curve)
        runs[f"TRL GRPOTrainer, {r['threads']} threads"].append((curve, {s: s * per_step for s in curve}))
    return runs


def table(runs: dict[str, list], thresholds: list[float]) -> str:
    head = "| system | seeds | final (mean ± sd) | mean curve |" + "".join(
        f" steps / s to {t:.2f} |" for t in thresholds
    )
    lines = [head, "|---" * (4 + len(thresholds)) + "|"]
    for name, cells in runs.items():
        finals = [c[max(c)] for c, _ in cells]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        steps = sorted(set.intersection(*(set(c) for c, _ in cells)))
        mean_curve = " ".join(f"{statistics.mean(c[s] for c, _ in cells):.3f}" for s in steps)
        row = f"| {name} | {len(cells)} | {statistics.mean(finals):.3f} ± {sd:.3f} | {mean_curve} |"
        for t in thresholds:
            hits = [h for h in (first_at(c, k, t) for c, k in cells) if h is not None]
            if hits:
                mean_steps, mean_s = statistics.mean(h[0] for h in hits), statistics.mean(h[1] for h in hits)
                row += f" {mean_steps:.0f} / {mean_s:.0f} ({len(hits)}/{len(cells)}) |"
            else:
                row += f" – (0/{len(cells)}) |"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--trl", default="")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.55, 0.6])
    args = ap.parse_args()
    runs = load_ours(args.ours)
    runs = dict(sorted(runs.items(), key=lambda kv: int(kv[0].rsplit(" ", 1)[-1])))
    if args.trl:
        runs.update(load_trl(args.trl))
    print(table(runs, args.thresholds))


if __name__ == "__main__":
    main()
