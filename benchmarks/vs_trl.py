"""Side by side with TRL's GRPOTrainer on the default job, from the same SFT checkpoint (issue 17).

    python benchmarks/vs_trl.py [--steps 800] [--seeds 1 2 3] [--trl-threads 2] [--systems ours trl]
                                [--variant NAME] [overrides of our config...]

TRL 1.16 runs in its own virtualenv (`scripts/setup_trl_venv.sh` builds .venv-trl; this script
builds it when missing) and the project never imports it: this file re-runs itself there with
`--trl-side SPEC.json`. Both systems get the same settings: 8 groups × 8 samples per step,
T 0.7, 24 new tokens, AdamW(β 0.9/0.99, no weight decay) at lr 2e-4 with the project's schedule
(`areal_core/train/schedule.py`: 20 warm-up steps, cosine to 0.1×), clip 0.2/0.28, no KL,
gradient clip 1.0, the prompts in the order our rollout worker takes them
(`admission.prompt_order`), the same reward (`gsm8k_reward`) and the same held-out evaluator
(`greedy_accuracy` on the 500 held-out problems, every `--eval-every` steps).

Measured per run: wall s/step and CPU s/step (all processes and threads) of the RL phase, the
held-out evaluations excluded (ours: `eval_s`/`eval_cpu_s` of the trainer's metrics; TRL: its
snapshots are saved at those steps, timed and subtracted, and evaluated afterwards here).
Prints one Markdown row per run, then the mean per system.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".venv-trl"


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def sft_checkpoint(root: str, overrides: list[str]) -> str:
    """The default job's SFT checkpoint under ROOT/sft (trained once, reused while committed)."""
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.store import Store

    store = Store(f"{root}/sft")
    if store.exists(LAYOUT.committed(LAYOUT.init_model)):
        return store.url(LAYOUT.init_model)
    uri, _ = pipeline.prepare("configs/default.yaml", [*overrides, f"store={root}/sft"])
    return pipeline.sft(uri)


def our_overrides(steps: int, eval_every: int, extra: list[str]) -> list[str]:
    """The overrides of every run of ours: no tracking, no progress bar, the steps and evaluation cadence."""
    return [
        "tracking.enabled=false",
        "launcher.progress=false",
        f"train.steps={steps}",
        f"train.eval_every={eval_every}",
        *extra,
    ]


def run_ours(root: str, init: str, seed: int, args: argparse.Namespace, base: list[str]) -> dict:
    from areal_core.context import load_run_config
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    name = f"ours-{args.variant}" if args.variant else "ours"
    uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"seed={seed}", f"store={root}/{name}-s{seed}"])
    store = Store(uri)
    pipeline.ensure_init_model(store, init)
    cfg = load_run_config(store)
    cpu0, t0 = children_cpu_s(), time.time()
    launch(uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=4 * 3600, progress=False)
    wall, cpu = time.time() - t0, children_cpu_s() - cpu0
    rows = pipeline.metrics_rows(store)
    evals = [r for r in rows if "eval_accuracy" in r]
    eval_s = sum(r.get("eval_s", 0.0) for r in evals)
    eval_cpu = sum(r.get("eval_cpu_s", 0.0) for r in evals)
    return {
        "system": name,
        "seed": seed,
        "threads": "1/role",
        "wall_s": wall - eval_s,
        "cpu_s": cpu - eval_cpu,
        "curve": {int(r["step"]): r["eval_accuracy"] for r in evals},
    }


def run_trl(root: str, init: str, seed: int, threads: int, args: argparse.Namespace) -> dict:
    """TRL in .venv-trl (this file with --trl-side), then its snapshots evaluated here."""
    import torch

    from areal_core.context import load_run_config
    from areal_core.evaluate import greedy_accuracy
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.rollout.admission import prompt_order
    from areal_core.store import Store

    if not (TRL_VENV / "bin" / "python").exists() or not list(TRL_VENV.glob(".installed-trl-*")):
        subprocess.run([str(ROOT / "scripts" / "setup_trl_venv.sh"), str(TRL_VENV)], check=True)
    sft = Store(f"{root}/sft")
    train = load_prompts(sft, "train")
    order = prompt_order(len(train), seed)
    groups = args.steps * 8
    out_dir = Path(root).resolve() / f"trl-s{seed}-t{threads}"
    spec = {
        "init": init.removeprefix("file://"),
        "seed": seed,
        "threads": threads,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "out": str(out_dir),
        "prompts": [
            {"prompt": train[order[g % len(order)]]["prompt"], "answer": train[order[g % len(order)]]["answer"]}
            for g in range(groups)
        ],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [str(TRL_VENV / "bin" / "python"), __file__, "--trl-side", str(out_dir / "spec.json")], check=True, env=env
    )
    res = json.loads((out_dir / "result.json").read_text())
    cfg = load_run_config(sft)
    records = load_prompts(sft, "eval")[: cfg.eval.num_samples]
    torch.set_num_threads(2)
    curve = {}
    for step, path in sorted(res["snapshots"].items(), key=lambda kv: int(kv[0])):
        model, tok = load_pretrained(path)
        curve[int(step)] = greedy_accuracy(model, tok, records, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    return {
        "system": "trl",
        "seed": seed,
        "threads": str(threads),
        "wall_s": res["wall_s"],
        "cpu_s": res["cpu_s"],
        "curve": curve,
    }


def _module(rel: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(rel.replace("/", ".")[:-3], ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def trl_side(spec_path: str) -> None:
    """Runs in .venv-trl: TRL's GRPOTrainer with the spec's settings; writes result.json."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # the same verifier and schedule as ours (stdlib-only modules, loaded by path: the project
    # root cannot go on sys.path here, its modules are imported by path to keep this process free of them)
    gsm8k_reward = _module("areal_core/reward/math.py").gsm8k_reward
    lr_factor = _module("areal_core/train/schedule.py").lr_factor
    from datasets import Dataset

    out = Path(spec["out"])
    tok = AutoTokenizer.from_pretrained(spec["init"])
    model = AutoModelForCausalLM.from_pretrained(spec["init"], dtype=torch.float32)
    ds = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"]} for p in spec["prompts"]]
    )

    def reward(completions, answer, **_):
        return [gsm8k_reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    steps, lr = spec["steps"], 2e-4
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, 20, "cosine", 0.1))
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=64,
        num_generations=8,
        generation_batch_size=64,
        temperature=0.7,
        max_completion_length=24,
        learning_rate=lr,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        use_cpu=True,
        seed=spec["seed"],
        save_strategy="no",
        gradient_checkpointing=False,  # TRL 1.16 turns it on by default; a 1M-parameter model needs no memory saving
        report_to="none",
        logging_steps=50,
        disable_dropout=True,
    )
    snaps: dict[int, str] = {}
    excluded = {"wall": 0.0, "cpu": 0.0}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % spec["eval_every"] == 0 or state.global_step == steps:
                w, c = time.perf_counter(), time.process_time()
                path = out / f"step-{state.global_step}"
                model.save_pretrained(path)
                tok.save_pretrained(path)
                snaps[state.global_step] = str(path)
                excluded["wall"] += time.perf_counter() - w
                excluded["cpu"] += time.process_time() - c

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        optimizers=(optimizer, scheduler),
        callbacks=[Snapshot()],
    )
    w, c = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - w - excluded["wall"], time.process_time() - c - excluded["cpu"]
    (out / "result.json").write_text(json.dumps({"wall_s": wall, "cpu_s": cpu, "snapshots": snaps}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-side":
        return trl_side(sys.argv[2])
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--trl-threads", type=int, nargs="+", default=[2])
    parser.add_argument("--systems", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--root", default="runs/vs-trl")
    parser.add_argument("--variant", default="", help="names our runs (ours-NAME) when comparing overrides")
    parser.add_argument("overrides", nargs="*", help="config overrides for our side")
    args = parser.parse_args()
    from areal_core.logs import setup_logging

    setup_logging()
    base = our_overrides(args.steps, args.eval_every, args.overrides)
    init = sft_checkpoint(args.root, ["tracking.enabled=false", "launcher.progress=false"])
    rows = []
    for seed in args.seeds:
        if "ours" in args.systems:
            rows.append(run_ours(args.root, init, seed, args, base))
            print("RESULT", json.dumps(rows[-1]), flush=True)
        if "trl" in args.systems:
            for threads in args.trl_threads:
                rows.append(run_trl(args.root, init, seed, threads, args))
                print("RESULT", json.dumps(rows[-1]), flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, steps={args.steps}")
    print("| system | threads | seed | wall s/step | CPU s/step | final held-out | curve |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        curve = [round(v, 3) for _, v in sorted(r["curve"].items())]
        final = curve[-1] if curve else float("nan")
        print(
            f"| {r['system']} | {r['threads']} | {r['seed']} | {r['wall_s'] / args.steps:.3f} | "
            f"{r['cpu_s'] / args.steps:.3f} | {final:.3f} | {' '.join(map(str, curve))} |"
        )
    for system in sorted({(r["system"], r["threads"]) for r in rows}):
        rs = [r for r in rows if (r["system"], r["threads"]) == system]
        finals = [r["curve"][max(r["curve"])] for r in rs if r["curve"]]
        print(
            f"mean {system[0]} ({system[1]} threads): wall {sum(r['wall_s'] for r in rs) / len(rs) / args.steps:.3f}"
            f" s/step, CPU {sum(r['cpu_s'] for r in rs) / len(rs) / args.steps:.3f} s/step, final held-out "
            f"{sum(finals) / max(len(finals), 1):.3f}"
        )


if __name__ == "__main__":
    main()
