"""How long building the run report takes for an 800-step run (issue 14: ≤ 2 s).

    PYTHONPATH=. python benchmarks/report_build.py [--steps 800] [--root RUN_URI] [--repeat 3]

Without --root it writes a simulated 800-step run root (config.yaml, trainer/metrics.jsonl and
the events of a trainer, two rollout workers and a reward worker, written through the real
`EventLog` with simulated timestamps: 17 records a step, as dense as a real tiny run's) to a temporary folder. It then
times `load_run` (reading every event part) and `render` (every chart) separately, best of
--repeat (wall and CPU seconds: on a busy machine the CPU time is the build's own), and prints
one JSON line with the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time

from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.report.data import load_run
from areal_core.report.html import page, render
from areal_core.store import Store


def simulate(root: str, steps: int = 800, rollout_workers: int = 2, seed: int = 0) -> None:
    """A run root whose events describe `steps` steps of a rollout-bound pipeline (1 s a step)."""
    rng = random.Random(seed)
    store = Store(root)
    store.write_text(LAYOUT.config, "name: simulated\ntrain:\n  eta: 2\n")
    start = time.time() - steps * 1.2
    trainer = EventLog(store, "trainer", "0", flush_every_s=0)
    rollouts = [EventLog(store, "rollout", str(i), flush_every_s=0) for i in range(rollout_workers)]
    reward = EventLog(store, "reward", "0", flush_every_s=0)
    rows = []
    t = start
    for step in range(steps):
        wait, train = 0.6 + rng.random() * 0.2, 0.3 + rng.random() * 0.1
        trainer.emit("span", t=t + wait, state="wait", on="batch", t0=t, t1=t + wait)
        for on, a, b in (("read", 0.0, 0.01), ("train", 0.01, train - 0.03), ("publish", train - 0.03, train)):
            trainer.emit("span", t=t + wait + b, state="busy", on=on, t0=t + wait + a, t1=t + wait + b)
        trainer.emit("phases", t=t + wait + train, step=step + 1, phases={"batch": wait, "train": train})
        end = t + wait + train
        hist = {"0": 4, "1": 3, "2": 1} if step else {"0": 8}
        trainer.emit("trained", t=end, step=step, samples=8, staleness=hist, dropped=0, abandoned=0)
        trainer.emit("publish", t=end, version=step + 1)
        trainer.emit("backlog", t=end, ungraded=rng.randint(0, 4), graded=rng.randint(0, 2), buffered_groups=1)
        for i, ev in enumerate(rollouts):
            ev.emit("span", t=end, state="busy", on="generate", t0=t, t1=end)
            ev.emit("load", t=end + 0.05 + 0.02 * i, version=step + 1)
            ev.emit("count", t=end, completions=4, tokens=4 * rng.randint(20, 60))
        reward.emit("span", t=t + 0.7, state="wait", on="shards", t0=t, t1=t + 0.7)
        reward.emit("span", t=end, state="busy", on="grade", t0=t + 0.7, t1=end)
        reward.emit("count", t=end, grades=8)
        if step and step % 50 == 0:
            for ev in (trainer, *rollouts, reward):
                ev.flush()
        row = {"step": step + 1, "reward_mean": min(1.0, 0.1 + step / steps + rng.random() * 0.1)}
        row |= {"kl_behav_prox": rng.random() * 1e-3, "importance_weight_mean": 1.0}
        row |= {"importance_weight_min": 0.9, "importance_weight_max": 1.1 + rng.random() * 0.2}
        if (step + 1) % 50 == 0:
            row["eval_accuracy"] = min(1.0, 0.2 + step / steps / 2)
        rows.append(row)
        t = end
    for ev in (trainer, *rollouts, reward):
        ev.close()
    store.write_text(LAYOUT.metrics, "\n".join(json.dumps(r) for r in rows) + "\n")
    store.write_text(LAYOUT.done, "")


def best_of(repeat: int, fn) -> tuple[float, float, object]:
    """(best wall seconds, best CPU seconds of this process, the result) over `repeat` calls."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--root", default="", help="an existing run root instead of a simulated one")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or os.path.join(tmp, "run")
        if not args.root:
            simulate(root, args.steps)
        store = Store(root)
        render(load_run(store))  # warm: imports, matplotlib's font cache
        load_s, load_cpu, data = best_of(args.repeat, lambda: load_run(store))
        render_s, render_cpu, html = best_of(args.repeat, lambda: page(render(data)))
    result = {
        "steps": len(data.rows),
        "records": len(data.records),
        "load_s": round(load_s, 3),
        "render_s": round(render_s, 3),
        "total_s": round(load_s + render_s, 3),
        "total_cpu_s": round(load_cpu + render_cpu, 3),  # the same on a machine shared with other jobs
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "html_kb": round(len(html) / 1024),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
