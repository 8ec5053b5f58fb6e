"""Calculator-agent training through the pipeline code path: prepare -> SFT -> asynchronous RL
(agent rollouts through the in-process proxy) -> held-out agent success before/after.

    PYTHONPATH=. .venv/bin/python benchmarks/agent_training.py --store /tmp/bench-agent \\
        --overrides "train.steps=20 train.lr=5e-4"

The same as `pyflyte run workflows/grpo.py grpo --config configs/agent_calculator.yaml`, without Flyte.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/agent_calculator.yaml")
    ap.add_argument("--store", default="/tmp/bench-agent")
    ap.add_argument("--overrides", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from areal_core import pipeline
    from areal_core.run_context import setup_logging

    setup_logging()
    t0 = time.time()
    overrides = [f"store={args.store}", "launcher.progress=false", *pipeline.parse_overrides(args.overrides)]
    run_uri, _ = pipeline.prepare(args.config, overrides)
    init = pipeline.sft(run_uri)
    t_sft = time.time() - t0
    pipeline.run_async_rl(run_uri, init)
    t_rl = time.time() - t0 - t_sft
    out = pipeline.evaluate_run(run_uri)
    result = {
        "config": args.config,
        "overrides": overrides,
        "success_before": out["before"],
        "success_after": out["after"],
        "sft_s": round(t_sft, 1),
        "rl_s": round(t_rl, 1),
        "wall_s": round(time.time() - t0, 1),
        "reward_mean_per_step": [round(r.get("reward_mean", 0.0), 3) for r in out["curves"]],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
