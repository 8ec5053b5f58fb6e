"""The default job in its production shapes (issue 25), from one SFT checkpoint, one seed each:

    local      1 trainer rank, 1 rollout and 1 reward worker, a local folder (the `make run` shape)
    fsdp2      train.nproc_per_node=2: the trainer under torchrun, 2 gloo ranks, FSDP2
    s3         2 rollout and 2 reward workers and the trainer on S3 (a moto server on 127.0.0.1)

    PYTHONPATH=. .venv/bin/python benchmarks/production_jobs.py [--jobs local,fsdp2,s3] [--steps 800]
        [--seed 1] [--eval-every 100] [--root runs/production-jobs] [overrides...]

Each job runs through the run launcher exactly as `benchmarks/vs_trl.py` runs ours (`run_ours`: wall and
CPU s/step with the trainer's held-out evaluations taken out, the held-out curve on the 500 problems);
the S3 job's SFT checkpoint is copied in by `ensure_init_model` like the others'. Prints a RESULT line per
job and a Markdown table, and writes ROOT/production_jobs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks.vs_trl import our_overrides, run_ours, sft_checkpoint
from benchmarks.weight_transfer import start_moto

JOBS: dict[str, list[str]] = {
    "local": [],
    "fsdp2": ["train.nproc_per_node=2"],
    "s3": ["rollout.num_workers=2", "reward.num_workers=2"],
}


def main(argv: list[str] | None = None) -> None:
    from areal_core.logs import setup_logging

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--root", default="runs/production-jobs")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    setup_logging()
    base = our_overrides(args.steps, args.eval_every, args.overrides)
    init = sft_checkpoint(args.root, ["tracking.enabled=false", "launcher.progress=false"])
    moto, results = None, []
    try:
        for job in args.jobs.split(","):
            root = args.root
            if job == "s3":
                moto, bucket = start_moto()
                root = f"{bucket}/production-jobs"
            ns = argparse.Namespace(variant=job)
            res = {**run_ours(root, init, args.seed, ns, [*base, *JOBS[job]]), "job": job, "overrides": JOBS[job]}
            results.append(res)
            print("RESULT", json.dumps(res), flush=True)
            Path(args.root).mkdir(parents=True, exist_ok=True)
            Path(args.root, "production_jobs.json").write_text(json.dumps(results, indent=2))
    finally:
        if moto is not None:
            moto.terminate()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    print(f"\nmachine: {cpu or platform.machine()}, {os.cpu_count()} cpus, steps={args.steps}, seed={args.seed}")
    print("| job | overrides | wall s/step | CPU s/step | final held-out | curve |")
    print("|---|---|---|---|---|---|")
    for r in results:
        curve = [round(v, 3) for _, v in sorted(r["curve"].items())]
        final = curve[-1] if curve else float("nan")
        print(
            f"| {r['job']} | {' '.join(r['overrides']) or '(default)'} | {r['wall_s'] / args.steps:.3f} |"
            f" {r['cpu_s'] / args.steps:.3f} | {final:.3f} | {' '.join(map(str, curve))} |"
        )


if __name__ == "__main__":
    sys.exit(main())
