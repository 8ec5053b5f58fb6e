"""RL on the default job from a given SFT checkpoint, with config overrides: compares RL settings.

    python benchmarks/rl_from_checkpoint.py NAME INIT_MODEL_DIR [overrides...]
    e.g. ... t07 runs/default/init_model rollout.temperature=0.7 train.lr_schedule=cosine train.lr_min_ratio=0.1

Prints one RESULT line: wall time, held-out accuracy before/after and the curve every eval_every steps.
"""

from __future__ import annotations

import json
import os
import sys
import time

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    name, init, *overrides = sys.argv[1:]
    setup_logging()
    base = ["tracking.enabled=false", "launcher.progress=false", f"store=runs/rl-settings/{name}"]
    run_uri, _ = pipeline.prepare("configs/default.yaml", [*base, *overrides])
    store = Store(run_uri)
    pipeline.ensure_init_model(store, os.path.abspath(init))
    t0 = time.time()
    launch(run_uri, 1, 1, timeout_s=3600, progress=False)
    wall = time.time() - t0
    acc = pipeline.evaluate_run(run_uri)
    rows = [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]
    curve = [round(r["eval_accuracy"], 3) for r in rows if "eval_accuracy" in r]
    print(
        f"RESULT {name} {overrides} wall={wall:.0f}s before={acc['before']:.3f} after={acc['after']:.3f} curve {curve}"
    )


if __name__ == "__main__":
    main()
