"""The default job with rollout.engine=vllm next to the built-in engine, same SFT start and steps.

    python benchmarks/vllm_vs_torch.py [--steps 60] [--engines torch vllm] [overrides...]

Needs .venv-vllm (`make vllm-venv`). SFT runs once; each engine starts RL from that checkpoint.
Prints a Markdown row per engine: RL wall time, mean training reward over the first and the last
10 steps, held-out greedy accuracy before/after RL, and the version swaps the rollout worker made.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from areal_core.logs import setup_logging
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store


def window_mean(rows: list[dict], key: str, first: bool, n: int = 10) -> float:
    vals = [r[key] for r in rows if key in r]
    part = vals[:n] if first else vals[-n:]
    return sum(part) / max(len(part), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--root", default="runs/bench-vllm")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup_logging()
    base = [f"train.steps={args.steps}", "tracking.enabled=false", "launcher.progress=false", *args.overrides]
    sft_uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"store={args.root}/sft"])
    init = pipeline.sft(sft_uri)
    rows = []
    for engine in args.engines:
        run_uri, _ = pipeline.prepare(
            "configs/default.yaml", [*base, f"store={args.root}/{engine}", f"rollout.engine={engine}"]
        )
        store = Store(run_uri)
        pipeline.ensure_init_model(store, init)
        t0 = time.time()
        launch(run_uri, 1, 1, timeout_s=7200, progress=False)
        wall = time.time() - t0
        acc = pipeline.evaluate_run(run_uri)
        curves = acc["curves"]
        status = store.statuses().get("rollout-0", {})
        rows.append(
            {
                "engine": engine,
                "wall_s": wall,
                "reward_first10": window_mean(curves, "reward_mean", True),
                "reward_last10": window_mean(curves, "reward_mean", False),
                "before": acc["before"],
                "after": acc["after"],
                "swaps": status.get("swaps"),
            }
        )
    print(f"\nsteps={args.steps}")
    print(
        "| engine | RL wall time (s) | reward, first 10 steps | last 10 steps | held-out acc before | after | swaps |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['wall_s']:.0f} | {r['reward_first10']:.3f} | {r['reward_last10']:.3f} "
            f"| {r['before']:.3f} | {r['after']:.3f} | {r['swaps']} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
