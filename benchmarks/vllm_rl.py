"""RL with vLLM as the rollout engine on SmolLM2-135M-Instruct (configs/smollm2_arithmetic.yaml, LoRA),
against the built-in continuous engine on the same config and seed.

    make vllm-venv
    PYTHONPATH=. .venv/bin/python benchmarks/vllm_rl.py [--engines continuous,vllm-merged,vllm-native]
        [--eval 200] [--root runs/vllm-rl] [--out vllm_rl.json] [overrides...]

Engines (every other setting from the config; one seed):
  continuous   the built-in engine (bf16 weights, the config's choice)
  continuous-slow  the built-in engine sleeping 1 s per engine step (rollout.step_delay_s): generation as
               slow as vLLM CPU's native LoRA decoding, everything else equal (the controlled experiment)
  continuous-slow-noswap  the same, a version installed only between generate calls (no mid-answer swap)
  continuous-slow-sync    the same at η = 0 (every batch from the newest version)
  vllm-merged  rollout.engine=vllm, each LoRA version merged into init_model and reloaded whole
               (rollout.server.lora=merged: the full-fine-tuning path)
  vllm-native  rollout.engine=vllm, each LoRA version loaded as the adapter `v{N}` by name
               (rollout.server.lora=native; auto picks merged on CPU)
Held-out greedy accuracy (the continuous engine, fp32, as in benchmarks/smollm2_rl.py) on --eval problems
before (init_model, once: every engine starts from it) and after (final_model of each run); RL wall time
(the launcher, the vLLM server's start included) and the rollout engine's start; s/step (the trainer's
steady rate: first to last trained step); publish → serving (the trainer's publish record of a version to
the rollout worker's load record: staged, checked and, for vLLM, served once `receive` returns); the
trainer's mismatch metrics per step: mean |log π_behav − log π_prox| (`abs_dlogp_behav_prox`) and
KL(behav‖prox) (`kl_behav_prox`). The load average (1 min) is read before and after each run.
Prints one RESULT line per engine and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.smollm2_rl import CONFIG, event_phases, greedy_accuracy, load_model, machine
from task_data.registry import load_task

VLLM = ["rollout.engine=vllm", "rollout.server.kv_cache_mb=512"]
ENGINES: dict[str, tuple[list[str], dict[str, str]]] = {
    "continuous": ([], {}),
    "continuous-slow": (["rollout.step_delay_s=1.0"], {}),
    "continuous-slow-noswap": (["rollout.step_delay_s=1.0", "rollout.swap_mid_generation=false"], {}),
    "continuous-slow-sync": (["rollout.step_delay_s=1.0", "train.eta=0"], {}),
    "vllm-merged": ([*VLLM, "rollout.server.lora=merged"], {}),
    "vllm-native": ([*VLLM, "rollout.server.lora=native"], {}),
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return machine()


def write_result(res: dict[str, Any], out: str) -> None:
    """Print one RESULT line (JSON) and, with `out`, write the same to that file."""
    print("RESULT " + json.dumps(res), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)


def steady_s_per_step(events: list[dict]) -> float:
    """Seconds per trained step from the trainer's `train` spans: first to last step end."""
    ends = sorted(e["t1"] for e in events if e["role"] == "trainer" and e["kind"] == "span" and e["on"] == "train")
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float("nan")


def mean_of(rows: list[dict], key: str) -> float:
    xs = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.mean(xs) if xs else float("nan")


def run_engine(name: str, args, heldout_cache: dict) -> dict[str, Any]:
    from areal_core.context import load_run_config
    from areal_core.events import read_events
    from areal_core.layout import LAYOUT
    from areal_core.models import localize
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    overrides, env = ENGINES[name]
    base = ["tracking.enabled=false", "launcher.progress=false", f"store={args.root}/{name}"]
    run_uri, _ = pipeline.prepare(args.config, [*base, *overrides, *args.overrides])
    pipeline.sft(run_uri)  # sft.enabled=false: copies model.path as init_model
    store = Store(run_uri)
    cfg = load_run_config(store)
    torch.set_num_threads(args.threads)
    _, heldout = load_task(cfg.task, cfg.seed)
    heldout = heldout[: args.eval]
    system, max_new = cfg.task.system_prompt, cfg.eval.max_new_tokens
    if args.before is not None:  # measured by another invocation on the same init_model
        heldout_cache.setdefault("before", args.before)
    if "before" not in heldout_cache:  # every engine starts from the same init_model
        model, tok = load_model(localize(store.url(LAYOUT.init_model)))
        heldout_cache["before"] = greedy_accuracy(model, tok, heldout, system, max_new)
        del model
        print(f"held-out before {heldout_cache['before']:.3f}", flush=True)
    load_before = os.getloadavg()[0]
    t0 = time.time()
    launch(run_uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=args.timeout, progress=False, env=env)
    wall = time.time() - t0
    load_after = os.getloadavg()[0]
    model, tok = load_model(localize(store.url(LAYOUT.final_model)))
    after = greedy_accuracy(model, tok, heldout, system, max_new)
    del model
    rows = [json.loads(x) for x in store.read_text(LAYOUT.metrics).splitlines() if x]
    events = read_events(store)
    starts = [e["seconds"] for e in events if e["kind"] == "load" and e["role"] == "rollout" and e["version"] == 0]
    res = {
        "engine": name,
        "overrides": [*overrides, *args.overrides],
        "env": env,
        "cpu": cpu_name(),
        "machine": machine(),
        "load_1min_before_after": [round(load_before, 2), round(load_after, 2)],
        "eval_n": len(heldout),
        "before": heldout_cache["before"],
        "after": after,
        "rl_wall_s": wall,
        "engine_start_s": starts[0] if starts else float("nan"),
        "steps": len(rows),
        "s_per_step": steady_s_per_step(events),
        "train_s_per_step": statistics.median(r["train_s"] for r in rows),
        "abs_dlogp_mean": mean_of(rows, "abs_dlogp_behav_prox"),
        "kl_behav_prox_mean": mean_of(rows, "kl_behav_prox"),
        "abs_dlogp_curve": [r.get("abs_dlogp_behav_prox") for r in rows],
        "reward_curve": [round(r.get("reward_mean", float("nan")), 3) for r in rows],
        **event_phases(store, len(rows)),
    }
    print(
        f"RESULT {name} before={res['before']:.3f} after={after:.3f} wall={wall:.0f}s "
        f"start={res['engine_start_s']:.0f}s"
        f" steps={len(rows)} s/step={res['s_per_step']:.1f} publish->serving={res['publish_to_loaded_s']:.2f}s"
        f" |dlogp|={res['abs_dlogp_mean']:.4f} kl={res['kl_behav_prox_mean']:.5f}"
        f" load={res['load_1min_before_after']}",
        flush=True,
    )
    return res


def markdown(results: list[dict]) -> str:
    lines = [
        "| engine | held-out before → after | RL wall (engine start) | s/step | publish → serving s |"
        " mean abs Δ log p | KL(behav‖prox) | load before/after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['before']:.3f} → {r['after']:.3f} | {r['rl_wall_s']:.0f} s"
            f" ({r['engine_start_s']:.0f} s) | {r['s_per_step']:.1f} | {r['publish_to_loaded_s']:.2f} |"
            f" {r['abs_dlogp_mean']:.4f} | {r['kl_behav_prox_mean']:.5f} |"
            f" {r['load_1min_before_after'][0]} / {r['load_1min_before_after'][1]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from areal_core.logs import setup_logging

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--root", default="runs/vllm-rl")
    ap.add_argument("--timeout", type=float, default=14400)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the held-out evaluation")
    ap.add_argument("--before", type=float, default=None, help="held-out accuracy before, if already measured")
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    setup_logging()
    cache: dict = {}
    results = []
    for name in args.engines.split(","):
        results.append(run_engine(name, args, cache))
        if args.out:  # after each engine: a long command keeps what it has measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    print(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
