"""The algorithm matrix on the embedded default task: held-out accuracy per (algorithm, η).

    PYTHONPATH=. .venv/bin/python benchmarks/algorithm_matrix.py [--steps 100] [--eval 200] \\
        [--algos grpo dr_grpo dapo rloo reinforce_pp naive_ppo] [--etas 0 1 2 4 8] \\
        [--extra gspo ppo_critic] [--extra-etas 2] [--root runs/bench-algos] [overrides...]

SFT runs once (configs/default.yaml); every cell starts from that checkpoint, runs the
asynchronous pipeline (one rollout, one reward and one trainer process, one thread each) for
`--steps` RL steps with `configs/algorithms/<algo>.yaml` and `train.eta=<η>`, then measures
greedy accuracy of the final model on the first `--eval` held-out problems (the SFT model's
accuracy on the same problems is measured once). A cell also records whether any trainer
metric was NaN/inf, the mean reward of the last 10 steps and the wall time.

`naive_ppo` (ratio to π_behav, no proximal policy) against `grpo` (decoupled PPO, same GRPO
advantages) across η is the decoupled-vs-naive comparison.

Cells run in priority order (every algorithm at η = 2 first, then the η sweeps of grpo and
naive_ppo, then the other sweeps), each
result is appended to <root>/results.jsonl at once, and a rerun skips finished cells, so an
interrupted matrix keeps what it measured. The markdown table goes to <root>/algorithm_matrix.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from areal_core.context import load_run_config
from areal_core.evaluate import greedy_accuracy
from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.models import load_pretrained
from areal_core.prompts import load_prompts
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store

ALGOS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "naive_ppo"]
EXTRA = ["gspo", "ppo_critic"]
ETAS = [0, 1, 2, 4, 8]


def cell_order(
    algos: list[str],
    etas: list[int],
    extra: list[str],
    extra_etas: list[int],
    first_eta: int,
    sweep_first: list[str],
    first_order: list[str] | None = None,
) -> list[tuple[str, int]]:
    """(algo, η) cells, most informative first: every algorithm at `first_eta` (in `first_order`,
    then the rest), then the η
    sweeps of `sweep_first` (e.g. decoupled GRPO vs naive PPO), then the other sweeps; η in the
    order given (e.g. `--etas 2 0 8 1 4` runs the extremes first)."""
    cells = [(a, e) for a in algos for e in etas] + [(a, e) for a in extra for e in extra_etas]
    order, eta_order = [*algos, *extra], list(dict.fromkeys([*etas, *extra_etas]))
    first = [a for a in (first_order or []) if a in order] + [a for a in order if a not in (first_order or [])]

    def key(c: tuple[str, int]) -> tuple:
        if c[1] == first_eta:
            return (0, first.index(c[0]))
        return (1, c[0] not in sweep_first, eta_order.index(c[1]), order.index(c[0]))

    return sorted(cells, key=key)


def accuracy(store: Store, rel: str, n: int) -> float:
    cfg = load_run_config(store)
    model, tokenizer = load_pretrained(store.url(rel), "cpu")
    records = load_prompts(store, "eval")[:n]
    return greedy_accuracy(model, tokenizer, records, cfg.eval.max_new_tokens, cfg.eval.batch_size)


def summarise_metrics(store: Store) -> dict:
    rows = pipeline.metrics_rows(store)
    bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
    last = rows[-10:]
    mean = lambda key: sum(r.get(key, 0.0) for r in last) / max(len(last), 1)  # noqa: E731
    out = {
        "steps_done": len(rows),
        "non_finite": bad,
        "reward_last10": mean("reward_mean"),
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in rows) / max(len(rows), 1),
        "dropped_samples": rows[-1].get("dropped_samples", 0) if rows else 0,
    }
    if any("explained_variance" in r for r in last):
        out["explained_variance_last10"] = mean("explained_variance")
    return out


def run_cell(algo: str, eta: int, args, base: list[str], init_uri: str) -> dict:
    config = f"configs/default.yaml,configs/algorithms/{algo}.yaml"
    run_uri, _ = pipeline.prepare(config, [*base, f"store={args.root}/{algo}-eta{eta}", f"train.eta={eta}"])
    store = Store(run_uri)
    pipeline.ensure_init_model(store, init_uri)
    t0 = time.time()
    launch(run_uri, 1, 1, timeout_s=args.cell_timeout, progress=False)
    wall = time.time() - t0
    after = accuracy(store, LAYOUT.final_model, args.eval)
    return {"algo": algo, "eta": eta, "after": after, "wall_s": wall, **summarise_metrics(store)}


def markdown(results: list[dict], before: float, args, algos: list[str], etas: list[int]) -> str:
    by = {(r["algo"], r["eta"]): r for r in results}
    all_algos = [a for a in [*algos, *args.extra] if any(k[0] == a for k in by)]
    all_etas = sorted({r["eta"] for r in results} | set(etas))
    lines = [
        f"SFT checkpoint: held-out greedy accuracy **{before:.3f}** on {args.eval} problems; "
        f"{args.steps} RL steps per cell, seed {args.seed}.",
        "",
        "Held-out greedy accuracy after RL (Δ vs SFT); `–` not run; NaN marks a non-finite metric:",
        "",
        "| algorithm | " + " | ".join(f"η = {e}" for e in all_etas) + " |",
        "|---|" + "---|" * len(all_etas),
    ]
    for a in all_algos:
        cells = []
        for e in all_etas:
            r = by.get((a, e))
            if r is None:
                cells.append("–")
                continue
            nan = " NaN" if r["non_finite"] else ""
            cells.append(f"{r['after']:.3f} ({r['after'] - before:+.3f}){nan}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| algorithm | η | acc after | Δ | reward (last 10 steps) | mean staleness | dropped | NaN/inf | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        extra = f", EV {r['explained_variance_last10']:.2f}" if "explained_variance_last10" in r else ""
        lines.append(
            f"| {r['algo']} | {r['eta']} | {r['after']:.3f} | {r['after'] - before:+.3f} | "
            f"{r['reward_last10']:.3f}{extra} | {r['staleness_mean']:.2f} | {int(r['dropped_samples'])} | "
            f"{', '.join(r['non_finite']) or 'none'} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--algos", nargs="+", default=ALGOS)
    parser.add_argument("--etas", type=int, nargs="+", default=ETAS)
    parser.add_argument("--extra", nargs="*", default=EXTRA, help="algorithms run only at --extra-etas")
    parser.add_argument("--extra-etas", type=int, nargs="*", default=[2])
    parser.add_argument("--first-eta", type=int, default=2, help="run every algorithm at this η first")
    parser.add_argument("--first-order", nargs="*", default=[], help="order of the cells at --first-eta")
    parser.add_argument("--sweep-first", nargs="*", default=["grpo", "naive_ppo"], help="their η sweeps go next")
    parser.add_argument("--root", default="runs/bench-algos")
    parser.add_argument("--cell-timeout", type=float, default=1800)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    setup_logging()
    base = [
        f"seed={args.seed}",
        f"train.steps={args.steps}",
        f"eval.num_samples={args.eval}",
        "train.eval_every=0",
        "threads_per_role=1",
        "tracking.enabled=false",
        "launcher.progress=false",
        *args.overrides,
    ]
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results_path = root / "results.jsonl"
    lines = results_path.read_text().splitlines() if results_path.exists() else []
    results = [r for r in map(json.loads, filter(None, lines)) if "error" not in r]  # failed cells rerun
    meta_path = root / "sft.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        sft_uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"store={args.root}/sft"])
        t0 = time.time()
        init = pipeline.sft(sft_uri)
        meta = {
            "init": init,
            "sft_s": time.time() - t0,
            "before": accuracy(Store(sft_uri), LAYOUT.init_model, args.eval),
        }
        meta_path.write_text(json.dumps(meta))
    print(f"SFT: held-out accuracy {meta['before']:.3f}", flush=True)
    done = {(r["algo"], r["eta"]) for r in results}
    for algo, eta in cell_order(
        args.algos, args.etas, args.extra, args.extra_etas, args.first_eta, args.sweep_first, args.first_order
    ):
        if (algo, eta) in done:
            continue
        try:
            r = run_cell(algo, eta, args, base, meta["init"])
        except Exception as exc:  # record the failure and go on with the other cells
            r = {"algo": algo, "eta": eta, "error": repr(exc)[:500]}
        with results_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
        if "error" not in r:
            results.append(r)
        write_table(root, results, meta["before"], args)
    print(write_table(root, results, meta["before"], args))


def write_table(root: Path, results: list[dict], before: float, args) -> str:
    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n\n"
    )
    text = header + markdown(results, before, args, args.algos, args.etas)
    (root / "algorithm_matrix.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
