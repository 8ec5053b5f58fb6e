"""η = 0 (synchronous) vs η = 2 (asynchronous) on the same number of training steps.

    python benchmarks/eta_sync_vs_async.py [--steps 400] [--etas 0 2] [overrides...]

SFT runs once; every η starts from that checkpoint. Prints a Markdown table row per η:
wall time of the RL phase, its ratio to η = 0, and held-out greedy accuracy before/after.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--root", default="runs/bench-eta")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    setup_logging()
    base = [f"train.steps={args.steps}", "tracking.enabled=false", "launcher.progress=false", *args.overrides]
    sft_uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"store={args.root}/sft"])
    init = pipeline.sft(sft_uri)
    rows = []
    for eta in args.etas:
        run_uri, _ = pipeline.prepare(
            "configs/default.yaml", [*base, f"store={args.root}/eta{eta}", f"train.eta={eta}"]
        )
        store = Store(run_uri)
        pipeline.ensure_init_model(store, init)
        t0 = time.time()
        launch(run_uri, 1, 1, timeout_s=3600, progress=False)
        wall = time.time() - t0
        acc = pipeline.evaluate_run(run_uri)
        rows.append({"eta": eta, "wall_s": wall, "before": acc["before"], "after": acc["after"]})
        assert store.exists(LAYOUT.committed(LAYOUT.init_model))
    sync = next((r["wall_s"] for r in rows if r["eta"] == 0), rows[0]["wall_s"])
    print(f"\nmachine: {platform.processor() or platform.machine()}, steps={args.steps}")
    print("| η | RL wall time (s) | speed-up vs η=0 | held-out acc before | after |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eta']} | {r['wall_s']:.1f} | {sync / r['wall_s']:.2f}× | {r['before']:.3f} | {r['after']:.3f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
