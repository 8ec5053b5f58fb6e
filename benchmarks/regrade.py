"""Re-grade throughput: a run's graded samples through a reward pool of 2, into a new layer.

    PYTHONPATH=. python benchmarks/regrade.py --run runs/default     # the default job after `make run`
    PYTHONPATH=. python benchmarks/regrade.py --steps 100            # no run root: a shorter default job
    PYTHONPATH=. python benchmarks/regrade.py --steps 30 --sft-steps 20   # quick, on a busy machine

`areal_core.reward.regrade.regrade` with the run's own reward (`gsm8k_reward`) into a fresh layer,
end to end: tokenizer load, reading every graded shard, decoding completions, the pool, writing
the re-graded shards, changes.parquet and the markers. Prints one JSON document: samples,
shards, seconds, setup seconds (config, tokenizer, pool), samples/s end to end and after setup
(best of `--repeat`), and the time those give the default job's 800 steps × 8 groups × 8 samples
= 51,200 trained samples (setup + 51,200 / grading rate; its graded layer holds a few more).
Without `--run`, a default-config run of `--steps` RL steps is made first (configs/default.yaml,
held-out evaluation off) in a temporary folder. The benchmark's layers are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_core.layout import LAYOUT  # noqa: E402
from areal_core.reward.regrade import regrade  # noqa: E402
from areal_core.store import Store  # noqa: E402

DEFAULT_JOB_SAMPLES = 800 * 8 * 8


def make_run(steps: int, sft_steps: int | None) -> str:
    """A default-config run of `steps` RL steps (and `sft_steps` SFT steps, default the config's)
    in a temporary folder; returns its URI."""
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch

    root = Path(tempfile.mkdtemp(prefix="areal-regrade-bench-")) / "run"
    uri, _ = pipeline.prepare(
        str(ROOT / "configs" / "default.yaml"),
        [
            f"store={root}",
            f"train.steps={steps}",
            "train.eval_every=0",
            "launcher.progress=false",
            "tracking.enabled=false",
            *([f"sft.steps={sft_steps}"] if sft_steps is not None else []),
        ],
    )
    pipeline.sft(uri)
    launch(uri, 1, 1, timeout_s=3600, progress=False)
    return uri


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a finished run root (default: make a shorter default job)")
    ap.add_argument("--steps", type=int, default=100, help="RL steps of the run made without --run")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps of that run (default: the config's 220)")
    ap.add_argument("--pool-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    t0 = time.time()
    uri = args.run or make_run(args.steps, args.sft_steps)
    made_s = time.time() - t0
    store = Store(uri)
    best = None
    for i in range(args.repeat):
        layer = f"bench-{os.getpid()}-{i}"
        try:
            report = regrade(store, into=layer, pool_size=args.pool_size)
        finally:
            store.delete(LAYOUT.layer_dir(layer), recursive=True)
        if best is None or report.samples_per_s > best.samples_per_s:
            best = report
    out = {
        "run": store.uri,
        "run_made_s": None if args.run else round(made_s, 1),
        "pool_size": args.pool_size,
        "shards": best.shards,
        "samples": best.samples,
        "seconds": round(best.seconds, 2),
        "setup_s": round(best.setup_seconds, 2),
        "samples_per_s": round(best.samples_per_s, 1),
        "grading_samples_per_s": round(best.grading_samples_per_s, 1),
        "changed": best.changed,
        "default_job_samples": DEFAULT_JOB_SAMPLES,
        "default_job_projected_s": round(best.setup_seconds + DEFAULT_JOB_SAMPLES / best.grading_samples_per_s, 1),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
