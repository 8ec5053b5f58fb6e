"""Replay speed against the original run's trainer time (areal_core/run/replay.py).

    PYTHONPATH=. .venv/bin/python benchmarks/replay.py --run runs/default --out /tmp/replay.json
    PYTHONPATH=. .venv/bin/python benchmarks/replay.py --short --out /tmp/replay.json   # makes a short run first

With `--run`, replays an existing run (the default job after `make run`: runs/default). With
`--short`, first makes a run of the tests' tiny config (--steps steps) in a temporary folder.
Replays it --repeats times into fresh roots under the run's own config and reports:

  run trainer elapsed   the run's trainer wall time to its last step (heartbeat elapsed_s):
                        waiting for rollouts, training, checkpoints, publication, evaluation
  run train_s           the sum of the run's own per-step train_s (the step alone)
  replay wall           the replay's wall time over its steps (reading the records' samples
                        from the shards, training, audit records, metrics; no publication)
  replay train_s        the sum of the replay's per-step train_s
  setup                 the replay call's total time minus its steps: config, copying the
                        initial model, reading every graded shard, the final model and DONE
and the largest relative loss / grad-norm difference from the run's steps (0: exact).
Medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from areal_core.run.replay import replay


def short_run(folder: Path, steps: int) -> str:
    from areal_core.run import pipeline
    from benchmarks.tiny_run import TINY

    run_uri, _ = pipeline.prepare("", [*TINY, f"store={folder / 'run'}", f"train.steps={steps}"])
    pipeline.run_async_rl(run_uri, pipeline.sft(run_uri))
    return run_uri


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="", help="a finished run root to replay")
    parser.add_argument("--short", action="store_true", help="make a short tiny run first")
    parser.add_argument("--steps", type=int, default=20, help="--short: the run's steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not args.run and not args.short:
        parser.error("give --run RUN_ROOT or --short")
    with tempfile.TemporaryDirectory() as tmp:
        run_uri = args.run or short_run(Path(tmp), args.steps)
        rows = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            rec = replay(run_uri, str(Path(tmp) / f"replay-{i}"))
            total = time.perf_counter() - t0
            rows.append({"total_s": total, "wall_s": rec["wall_s"], "train_s": rec["train_s"], "rec": rec})
    rec = rows[-1]["rec"]
    med = {k: statistics.median(r[k] for r in rows) for k in ("total_s", "wall_s", "train_s")}
    src = rec["source_trainer"]
    out = {
        "run": run_uri,
        "steps": rec["steps"],
        "samples": rec["samples"],
        "run_trainer_elapsed_s": src["elapsed_s"],
        "run_train_s": src["train_s"],
        "replay_wall_s": med["wall_s"],
        "replay_train_s": med["train_s"],
        "setup_s": med["total_s"] - med["wall_s"],
        "speedup_vs_run_trainer": src["elapsed_s"] / max(med["wall_s"], 1e-9),
        "max_rel_diff": rec["max_rel_diff"],
        "machine": (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
        ),
        "repeats": args.repeats,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
