"""Side by side with TRL's GRPOTrainer on the default job, from the same SFT checkpoint (issue 17), or on a
reasoning-gym task from the pretrained SmolLM2 (issue 53).

    python benchmarks/vs_trl.py [--steps 800] [--seeds 1 2 3] [--trl-threads 2] [--systems ours trl]
                                [--variant NAME] [overrides of our config...]
    python benchmarks/vs_trl.py --config configs/smollm2_reasoning_gym.yaml --gym NAME [--steps 60]
                                [--eval-every 10] [--threshold X] [...]

TRL 1.16 runs in its own virtualenv (`scripts/setup_trl_venv.sh` builds .venv-trl; this script
builds it when missing) and the project never imports it: benchmarks/vs_trl_side.py runs there
with a SPEC.json this file writes. Both systems get the same settings: 8 groups × 8 samples per step,
T 0.7, 24 new tokens, AdamW(β 0.9/0.99, no weight decay) at lr 2e-4 with the project's schedule
(`areal_core/train/schedule.py`: 20 warm-up steps, cosine to 0.1×), clip 0.2/0.28, no KL,
gradient clip 1.0, the prompts in the order our rollout worker takes them
(`admission.prompt_order`), the same reward (`gsm8k_reward`) and the same held-out evaluator
(`greedy_accuracy` on the 500 held-out problems, every `--eval-every` steps).

Measured per run: wall s/step and CPU s/step (all processes and threads) of the RL phase, the
held-out evaluations excluded (ours: `eval_s`/`eval_cpu_s` of the trainer's metrics; TRL: its
snapshots are saved at those steps, timed and subtracted, and evaluated afterwards here).
Prints one Markdown row per run, then the mean per system.

`--config` (another job; the default is configs/default.yaml's) takes every setting above from that config instead:
group size, groups per step, temperature, top-p, new tokens, lr, schedule, warm-up and floor, weight decay, clip,
KL, gradient clip; its LoRA (train.lora_rank/alpha/target_modules) as a peft LoraConfig of the same rank, alpha and
layers on TRL's side; its task's reward (reasoning_gym: the dataset's score_answer on reasoning_gym's
extract_answer, with the entries the records carry); its prompts as chat messages (system prompt, a record's chat,
the question: what our rollout renders, checked token for token on TRL's side) in our rollout order, from a run
root prepared with the same config and seed (a reasoning-gym seed draws other questions); and its evaluator
(`heldout_score` on eval.num_samples held-out records). The initial model is the config's SFT checkpoint, or
model.path itself when sft.enabled is false. `--gym NAME` sets task.gym to NAME's easy config in
benchmarks/reasoning_gym_probe.py (or takes task.gym's own syntax). Also per seed: the held-out accuracy before
RL; per run: the seconds to each evaluation from the start (ours: the launch, roles' start-up included; TRL: its
process, imports and model load included), the evaluations left out; and the steps and seconds to `--threshold`
(default: TRL's mean final accuracy), with their means over seeds. Results also go to ROOT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".venv-trl"
TRL_SIDE = ROOT / "benchmarks" / "vs_trl_side.py"  # run by .venv-trl's python; it never imports the project
DEFAULT_CONFIG = "configs/default.yaml"


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def gym_overrides(gym: str) -> list[str]:
    """--gym: a dataset of benchmarks/reasoning_gym_probe.py's CANDIDATES as its easy config there; anything else
    as task.gym's own syntax (`name[:weight],...`, or YAML)."""
    if not gym:
        return []
    from benchmarks.reasoning_gym_probe import CANDIDATES

    if gym in CANDIDATES:
        return [f"task.gym={json.dumps([{'name': gym, 'config': CANDIDATES[gym]}])}"]
    return [f"task.gym={gym}"]


def sft_checkpoint(root: str, config: str, overrides: list[str]) -> str:
    """The job's initial checkpoint under ROOT/sft (trained once, reused while committed): its SFT warm start, or a
    copy of model.path when the config disables SFT."""
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.store import Store

    store = Store(f"{root}/sft")
    if store.exists(LAYOUT.committed(LAYOUT.init_model)):
        return store.url(LAYOUT.init_model)
    uri, _ = pipeline.prepare(config, [*overrides, f"store={root}/sft"])
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


def trainer_clock(store, t0: float) -> dict[int, float]:
    """metrics step s -> seconds from `t0` (the launch) to the end of step s (the trainer's "trained" event), minus
    the evaluations of the steps before s."""
    from areal_core.events import read_events
    from areal_core.run import pipeline

    trained = {int(e["step"]) + 1: e["t"] - t0 for e in read_events(store) if e["kind"] == "trained"}
    eval_s = {int(r["step"]): r.get("eval_s", 0.0) for r in pipeline.metrics_rows(store) if "eval_accuracy" in r}
    return {s: t - sum(v for k, v in eval_s.items() if k < s) for s, t in trained.items()}


def run_ours(root: str, init: str, seed: int, args: argparse.Namespace, base: list[str]) -> dict:
    from areal_core.context import load_run_config
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    name = f"ours-{args.variant}" if args.variant else "ours"
    uri, _ = pipeline.prepare(args.config, [*base, f"seed={seed}", f"store={root}/{name}-s{seed}"])
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
    clock = trainer_clock(store, t0)
    return {
        "system": name,
        "seed": seed,
        "threads": "1/role",
        "wall_s": wall - eval_s,
        "cpu_s": cpu - eval_cpu,
        "curve": {int(r["step"]): r["eval_accuracy"] for r in evals},
        "clock": {int(r["step"]): clock.get(int(r["step"])) for r in evals},
    }


def seed_data(root: str, seed: int, args: argparse.Namespace, base: list[str]):
    """(train records, eval records, run config) of the seed: the SFT root's for the default job (as issue 17's
    table had them), else a root prepared with the config and seed (its questions depend on the seed)."""
    from areal_core.context import load_run_config
    from areal_core.prompts import load_prompts
    from areal_core.run import pipeline
    from areal_core.store import Store

    if args.config == DEFAULT_CONFIG:
        store = Store(f"{root}/sft")
    else:
        from areal_core.run.ownership import read_lease, renew

        uri, _ = pipeline.prepare(args.config, [*base, f"seed={seed}", f"store={root}/data-s{seed}"])
        store = Store(uri)
        renew(store, read_lease(store)[0].run_id, "done")  # prepared only, never run: it may be prepared again
    cfg = load_run_config(store)
    return load_prompts(store, "train"), load_prompts(store, "eval")[: cfg.eval.num_samples], cfg


def heldout(path: str, cfg, records: list[dict], adapter: str = "") -> float:
    """Held-out score (our evaluator) of the checkpoint at `path`, with a peft adapter folder merged in."""
    from areal_core.evaluate import heldout_score
    from areal_core.models import load_pretrained

    model, tok = load_pretrained(path)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return heldout_score(model, tok, cfg, records)


def before(root: str, init: str, seed: int, data: tuple) -> float:
    """Held-out accuracy of the initial checkpoint on the seed's held-out records (`seed_data`; cached in ROOT)."""
    import torch

    _, records, cfg = data
    cache = Path(root) / f"before-s{seed}-n{len(records)}-t{cfg.eval.max_new_tokens}.json"
    if cache.exists():
        return json.loads(cache.read_text())["accuracy"]
    torch.set_num_threads(2)
    acc = heldout(init.removeprefix("file://"), cfg, records)
    cache.write_text(json.dumps({"accuracy": acc}))
    return acc


def trl_spec(init: str, seed: int, threads: int, args: argparse.Namespace, train: list[dict], cfg) -> dict:
    """What the TRL side is given: our run's settings (module docstring) and its prompts in our rollout order."""
    from areal_core.models import load_pretrained, prompt_messages, record_prompt
    from areal_core.reward.pool import reward_function
    from areal_core.rollout.admission import prompt_order

    order = prompt_order(len(train), seed)
    picked = [train[order[g % len(order)]] for g in range(args.steps * cfg.train.batch_groups)]
    model, tok = load_pretrained(init)
    t, a, r = cfg.train, cfg.algo, cfg.rollout
    lora = None
    if t.lora_rank > 0:
        from areal_core.architecture import resolve_lora_targets

        targets = resolve_lora_targets(model, t.lora_target_modules)
        lora = {"r": t.lora_rank, "alpha": t.lora_alpha, "targets": targets}
    kind = {"areal_core.reward.math:gsm8k_reward": "gsm8k", "task_data.reasoning_gym:gym_reward": "reasoning_gym"}
    reward = kind.get(reward_function(cfg))
    if reward is None:
        raise SystemExit(
            f"vs_trl.py grades with gsm8k_reward or gym_reward; this config's reward is {reward_function(cfg)}"
        )

    def prompt(rec: dict) -> dict:
        chat = (rec.get("meta") or {}).get("chat")
        out = {"prompt": prompt_messages(rec["prompt"], cfg.task.system_prompt, chat), "answer": rec["answer"]}
        if reward == "reasoning_gym":
            out["rg"] = json.dumps(rec["meta"]["reasoning_gym"])
        return out

    return {
        "init": init.removeprefix("file://"),
        "seed": seed,
        "threads": threads,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "reward": reward,
        "lora": lora,
        "group": r.group_size,
        "batch": t.batch_groups * r.group_size,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "max_new": r.max_new_tokens,
        "lr": t.lr,
        "schedule": [t.lr_warmup_steps, t.lr_schedule, t.lr_min_ratio],
        "weight_decay": t.weight_decay,
        "clip": [a.eps_low, a.eps_high],
        "kl": a.kl_coef,
        "grad_clip": t.grad_clip,
        "first_prompt_ids": record_prompt(tok, picked[0], cfg.task.system_prompt, cfg.task.prompt_format),
        "prompts": [prompt(rec) for rec in picked],
    }


def run_trl(root: str, init: str, seed: int, threads: int, args: argparse.Namespace, data: tuple) -> dict:
    """TRL in .venv-trl (benchmarks/vs_trl_side.py) on the seed's records (`seed_data`), then its snapshots evaluated
    here."""
    import torch

    subprocess.run([str(ROOT / "scripts" / "setup_trl_venv.sh"), str(TRL_VENV)], check=True)  # at once when built
    train, records, cfg = data
    out_dir = Path(root).resolve() / f"trl-s{seed}-t{threads}"
    spec = {**trl_spec(init, seed, threads, args, train, cfg), "out": str(out_dir)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    subprocess.run([str(TRL_VENV / "bin" / "python"), str(TRL_SIDE), str(out_dir / "spec.json")], check=True, env=env)
    res = json.loads((out_dir / "result.json").read_text())
    torch.set_num_threads(2)
    curve = {}
    for step, path in sorted(res["snapshots"].items(), key=lambda kv: int(kv[0])):
        curve[int(step)] = (
            heldout(spec["init"], cfg, records, adapter=path) if spec["lora"] else heldout(path, cfg, records)
        )
    return {
        "system": "trl",
        "seed": seed,
        "threads": str(threads),
        "wall_s": res["wall_s"],
        "cpu_s": res["cpu_s"],
        "curve": curve,
        "clock": {int(k): v - t0 for k, v in res["step_end"].items() if int(k) in curve},
    }


def first_at(r: dict, threshold: float) -> tuple[int, float | None] | None:
    """(step, seconds) of the run's first evaluation at or above `threshold`; None when none is."""
    for step in sorted(r["curve"]):
        if r["curve"][step] >= threshold - 1e-9:
            return step, r["clock"].get(step)
    return None


def report(rows: list[dict], args: argparse.Namespace, befores: dict[int, float]) -> None:
    """The Markdown rows, the means per system and, with a threshold, the steps and seconds to reach it."""
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    final = lambda r: r["curve"][max(r["curve"])] if r["curve"] else float("nan")  # noqa: E731
    trl_finals = [final(r) for r in rows if r["system"] == "trl" and r["curve"]]
    threshold = args.threshold if args.threshold is not None else (mean(trl_finals) if trl_finals else None)
    hit = lambda r: first_at(r, threshold) if threshold is not None else None  # noqa: E731
    from benchmarks.reasoning_gym_probe import cpu_name

    print(f"\nmachine: {cpu_name()}, steps={args.steps}")
    if befores:
        print("held-out before RL, per seed: " + ", ".join(f"s{k} {v:.3f}" for k, v in sorted(befores.items())))
    thr = "–" if threshold is None else f"{threshold:.3f}"
    print(f"| system | threads | seed | wall s/step | CPU s/step | final held-out | steps / s to {thr} | curve |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        curve = " ".join(str(round(v, 3)) for _, v in sorted(r["curve"].items()))
        h = hit(r)
        to = f"{h[0]} / {h[1]:.0f}" if h and h[1] is not None else "–"
        per_step = f"{r['wall_s'] / args.steps:.3f} | {r['cpu_s'] / args.steps:.3f}"
        print(f"| {r['system']} | {r['threads']} | {r['seed']} | {per_step} | {final(r):.3f} | {to} | {curve} |")
    seconds = {}
    for system in sorted({(r["system"], r["threads"]) for r in rows}):
        rs = [r for r in rows if (r["system"], r["threads"]) == system]
        hits = [h for h in map(hit, rs) if h and h[1] is not None]
        seconds[system] = mean([h[1] for h in hits]) if hits else None
        to = f", to {thr}: {mean([h[0] for h in hits]):.1f} steps / {seconds[system]:.0f} s" if hits else ""
        print(
            f"mean {system[0]} ({system[1]} threads): wall {mean([r['wall_s'] for r in rs]) / args.steps:.3f}"
            f" s/step, CPU {mean([r['cpu_s'] for r in rs]) / args.steps:.3f} s/step, final held-out "
            f"{mean([final(r) for r in rs if r['curve']]):.3f}{to} ({len(hits)}/{len(rs)} reached {thr})"
        )
    ours = [v for (name, _), v in seconds.items() if name != "trl" and v]
    for (name, threads), v in seconds.items():
        if name == "trl" and v and ours:
            print(f"time to {thr}: TRL ({threads} threads) / ours = {v / ours[0]:.2f}x (goal: >= 2.5x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="our job (default: the default job, issue 17)")
    parser.add_argument("--gym", default="", help="reasoning_gym: task.gym (a probe dataset's name: its easy config)")
    parser.add_argument("--steps", type=int, default=None, help="default: 800, or the config's train.steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-every", type=int, default=None, help="default: 100, or the config's train.eval_every")
    parser.add_argument("--threshold", type=float, default=None, help="held-out accuracy (default: TRL's mean final)")
    parser.add_argument("--trl-threads", type=int, nargs="+", default=[2])
    parser.add_argument("--systems", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--root", default="", help="default: runs/vs-trl, runs/vs-trl-<config>[-<gym>]")
    parser.add_argument("--variant", default="", help="names our runs (ours-NAME) when comparing overrides")
    parser.add_argument("overrides", nargs="*", help="config overrides for our side")
    args = parser.parse_args()
    if args.steps is None or args.eval_every is None:
        from areal_core.config import load_config

        train = load_config(args.config, []).train
        default_job = args.config == DEFAULT_CONFIG
        args.steps = args.steps or (800 if default_job else train.steps)
        args.eval_every = args.eval_every or (100 if default_job else train.eval_every or args.steps)
    if not args.root:
        job = "" if args.config == DEFAULT_CONFIG else "-" + Path(args.config).stem
        args.root = f"runs/vs-trl{job}" + (f"-{args.gym.split(':')[0].split(',')[0]}" if args.gym else "")
    from areal_core.logs import setup_logging

    setup_logging()
    task = gym_overrides(args.gym)
    base = our_overrides(args.steps, args.eval_every, [*task, *args.overrides])
    init = sft_checkpoint(args.root, args.config, ["tracking.enabled=false", "launcher.progress=false", *task])
    default_job = args.config == DEFAULT_CONFIG
    rows, befores = [], {}
    for seed in args.seeds:
        data = seed_data(args.root, seed, args, base) if "trl" in args.systems or not default_job else None
        if not default_job:  # the issue 17 table has no "before" column
            befores[seed] = before(args.root, init, seed, data)
            print("BEFORE", json.dumps({"seed": seed, "accuracy": befores[seed]}), flush=True)
        if "ours" in args.systems:
            rows.append(run_ours(args.root, init, seed, args, base))
            print("RESULT", json.dumps(rows[-1]), flush=True)
        if "trl" in args.systems:
            for threads in args.trl_threads:
                rows.append(run_trl(args.root, init, seed, threads, args, data))
                print("RESULT", json.dumps(rows[-1]), flush=True)
    Path(args.root, "results.json").write_text(json.dumps({"args": vars(args), "before": befores, "rows": rows}))
    report(rows, args, befores)


if __name__ == "__main__":
    main()
