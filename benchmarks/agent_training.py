"""Calculator-agent training through the pipeline code path: prepare -> SFT -> asynchronous RL
(agent rollouts through the in-process proxy) -> held-out agent success before/after.

    PYTHONPATH=. .venv/bin/python benchmarks/agent_training.py --store /tmp/bench-agent \\
        --overrides "train.steps=200" --curve-every 50

The same as `pyflyte run workflows/grpo.py grpo --config configs/agent_calculator.yaml`, without
Flyte. With `--curve-every K` a thread copies every K-th published version (weights/v{K}, v{2K},
...) while RL runs (the trainer prunes old versions) and scores each on the same held-out tasks
after the run, for a curve of held-out success against RL steps.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def _capture(store, every: int, stop: threading.Event, out: dict[int, dict]) -> None:
    """Copy the state dict of every `every`-th published version until `stop`."""
    from areal_core.weights.reader import load_state_dict

    while not stop.is_set():
        latest = store.latest_version()
        if latest is not None:
            for v in range(every, latest + 1, every):
                if v not in out:
                    try:
                        out[v] = {k: t.clone() for k, t in load_state_dict(store, v).items()}
                    except Exception:  # noqa: BLE001 - pruned before we got to it: skip that point
                        out[v] = {}
        stop.wait(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/agent_calculator.yaml")
    ap.add_argument("--store", default="/tmp/bench-agent")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--curve-every", type=int, default=0, help="score every K-th version after the run (0: off)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from areal_core.context import load_run_config
    from areal_core.evaluate import heldout_score
    from areal_core.layout import LAYOUT
    from areal_core.logs import setup_logging
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.run import pipeline
    from areal_core.store import Store

    setup_logging()
    t0 = time.time()
    overrides = [f"store={args.store}", "launcher.progress=false", *pipeline.parse_overrides(args.overrides)]
    run_uri, _ = pipeline.prepare(args.config, overrides)
    init = pipeline.sft(run_uri)
    t_sft = time.time() - t0
    store = Store(run_uri)
    captured: dict[int, dict] = {}
    stop = threading.Event()
    watcher = None
    if args.curve_every > 0:
        watcher = threading.Thread(target=_capture, args=(store, args.curve_every, stop, captured), daemon=True)
        watcher.start()
    pipeline.run_async_rl(run_uri, init)
    t_rl = time.time() - t0 - t_sft
    stop.set()
    if watcher is not None:
        watcher.join()
    out = pipeline.evaluate_run(run_uri)
    curve: dict[int, float | None] = {}
    cfg = load_run_config(store)
    records = load_prompts(store, "eval")[: cfg.eval.num_samples]
    if captured:
        model, tokenizer = load_pretrained(store.url(LAYOUT.init_model), cfg.device)
        for v in sorted(captured):
            if not captured[v]:
                curve[v] = None
                continue
            model.load_state_dict(captured[v], strict=False)
            curve[v] = round(heldout_score(model, tokenizer, cfg, records), 3)
    metrics = out["curves"]
    result = {
        "config": args.config,
        "overrides": overrides,
        "heldout_tasks": len(records),
        "success_before": out["before"],
        "success_after": out["after"],
        "success_by_version": curve,
        "sft_s": round(t_sft, 1),
        "rl_s": round(t_rl, 1),
        "rl_steps": len(metrics),
        "s_per_step": round(t_rl / max(len(metrics), 1), 2),
        "wall_s": round(time.time() - t0, 1),
        "reward_mean_per_step": [round(r.get("reward_mean", 0.0), 3) for r in metrics],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
