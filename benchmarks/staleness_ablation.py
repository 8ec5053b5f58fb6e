"""AReaL's staleness ablation on our cores: naive PPO against decoupled PPO as the staleness bound η grows (issue 27).

    PYTHONPATH=. .venv/bin/python benchmarks/staleness_ablation.py [--etas 0 1 2 4 8 16 inf] \\
        [--losses ppo decoupled_ppo] [--seeds 1 2 3] [--steps 800] [--eval-every 100] [--threshold 0.5] \\
        [--lr 3e-4] [--rollout-workers 1] [--root runs/staleness-ablation] [--init URI] [overrides...]

Every cell (loss, η, seed) starts from one SFT checkpoint of the default job (`vs_trl.sft_checkpoint`,
trained once under ROOT/sft, or `--init`), runs the asynchronous pipeline (`--rollout-workers`
rollout, one reward and one trainer process, one thread each) on configs/default.yaml with
`algo.loss=<loss>`, `train.eta=<η>`, `train.lr=<lr>` and `seed=<seed>` for `--steps` steps, the
trainer evaluating greedy held-out accuracy every `--eval-every` steps. `ppo` is naive PPO (ratio
to π_behav, no proximal policy: configs/algorithms/naive_ppo.yaml), `decoupled_ppo` the default
(ratio to π_prox, π_prox/π_behav truncated at 5). Per cell, from trainer/metrics.jsonl and the
trainer's events:

- final held-out accuracy (the evaluation at the last step) and the curve;
- time to accuracy: the first evaluation step reaching `--threshold`, and the trainer's wall time
  to it (its "trained" event, minus the time spent in the earlier evaluations);
- KL(behaviour‖proximal), the mean over steps of mean_t (log π_behav − log π_prox), and the
  staleness actually trained (versions behind, mean and max);
- the importance-weight range: the median over steps of the per-step smallest and largest
  w = π_prox/π_behav and its extremes (decoupled cells; naive PPO has no weight, w = 1: its
  off-policy signal is the clip fraction of r = π_θ/π_behav, also reported).

η = ∞ is `train.eta=1000000` (`INF`): `train.eta` is a non-negative int with no upper bound; at
that value admission, (v + η + 1)·B groups, never binds and no sample is ever too stale, so the
rollout runs as far ahead as its speed allows.

The setting, and why: the default job, whose trainer is the bottleneck, so the rollout always
reaches the admission limit and every sample is η versions old (docs/benchmarks.md, issue 27);
more rollout workers would not make samples staler, only take the trainer's CPU on a 2-core
machine (`--rollout-workers` is there for a bigger one). The lever is the learning rate: at the
default 2e-4, KL(behav‖prox) is ~1e-4 at η = 2 (issue 27) and ~1e-2 at η = 8 (the algorithm
matrix), too little for the two losses to differ within seed noise; at 3e-4 the default job (η = 2,
decoupled) collapsed from 0.36 to 0.18 by step 150 and recovered slowly (docs/benchmarks.md), so
the policy moves far per version there, and the η = 0 cells say whether that collapse is
staleness. The threshold defaults to 0.5, not 0.6: at 3e-4 a 500-step run ended at 0.41, and a
time-to-accuracy no cell reaches says nothing. The tiny model, not SmolLM2-135M: 14 cells × 3
seeds of 800 steps are a few CPU-hours for it (about 0.2–0.45 s a step, plus the evaluations) and
days for SmolLM2 on this machine.

Cells run seed by seed (the first seed's whole sweep first), each result appended to
ROOT/results.jsonl at once; a rerun skips finished cells and restarts unfinished ones. The
Markdown table goes to ROOT/staleness_ablation.md and stdout, the plot (accuracy against η for
both losses, mean ± sd over seeds) to ROOT/staleness_ablation.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.algorithm_matrix import summarise_metrics
from benchmarks.vs_trl import sft_checkpoint

INF = 1_000_000  # train.eta standing for η = ∞ (see the module docstring)
ETAS = ["0", "1", "2", "4", "8", "16", "inf"]
LOSSES = ["ppo", "decoupled_ppo"]
LABEL = {"ppo": "naive PPO", "decoupled_ppo": "decoupled PPO"}


def eta_value(eta: str) -> int:
    return INF if eta in ("inf", "∞") else int(eta)


def eta_label(eta: int) -> str:
    return "∞" if eta >= INF else str(eta)


def cell_name(loss: str, eta: int, seed: int) -> str:
    return f"{loss}-eta{eta_label(eta).replace('∞', 'inf')}-s{seed}"


def trainer_clock(store) -> dict[int, float]:
    """metrics step s -> the trainer's wall seconds from its first event to the end of step s (its
    "trained" event), minus the seconds of the evaluations that ran before that step."""
    from areal_core.events import read_events
    from areal_core.run import pipeline

    events = [e for e in read_events(store) if e["role"] == "trainer"]
    if not events:
        return {}
    t0 = events[0]["t"]
    trained = {int(e["step"]) + 1: e["t"] - t0 for e in events if e["kind"] == "trained"}
    eval_s = {int(r["step"]): r.get("eval_s", 0.0) for r in pipeline.metrics_rows(store) if "eval_accuracy" in r}
    return {s: t - sum(v for k, v in eval_s.items() if k < s) for s, t in trained.items()}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cell_result(store, loss: str, eta: int, seed: int, wall_s: float) -> dict:
    """One finished cell's figures (module docstring) from its run root; `curve` and `clock` map each
    evaluation step to the accuracy and to the trainer's seconds (time to accuracy: `reached`)."""
    from areal_core.run import pipeline

    rows = pipeline.metrics_rows(store)
    curve = {int(r["step"]): r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    clock = trainer_clock(store)
    pick = lambda key: [r[key] for r in rows if key in r]  # noqa: E731
    return {
        "loss": loss,
        "eta": eta,
        "seed": seed,
        "final": curve[max(curve)] if curve else float("nan"),
        "curve": curve,
        "clock": {s: clock.get(s) for s in curve},
        "train_s": clock.get(max(clock)) if clock else None,
        "wall_s": wall_s,
        "kl_behav_prox": statistics.fmean(pick("kl_behav_prox")) if pick("kl_behav_prox") else float("nan"),
        "w_min_median": median(pick("importance_weight_min")),
        "w_max_median": median(pick("importance_weight_max")),
        "w_min": min(pick("importance_weight_min"), default=float("nan")),
        "w_max": max(pick("importance_weight_max"), default=float("nan")),
        "clip_frac": statistics.fmean(pick("clip_frac")) if pick("clip_frac") else float("nan"),
        "staleness_max": max(pick("staleness_max"), default=0),
        **summarise_metrics(store),
    }


def run_cell(loss: str, eta: int, seed: int, args: argparse.Namespace, base: list[str], init: str) -> dict:
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    root = Path(args.root) / cell_name(loss, eta, seed)
    if root.exists():  # an unfinished cell of an interrupted invocation: start it again
        shutil.rmtree(root)
    overrides = [*base, f"algo.loss={loss}", f"train.eta={eta}", f"seed={seed}", f"store={root}"]
    uri, _ = pipeline.prepare("configs/default.yaml", overrides)
    store = Store(uri)
    pipeline.ensure_init_model(store, init)
    t0 = time.time()
    launch(uri, args.rollout_workers, 1, timeout_s=args.cell_timeout, progress=False)
    return cell_result(store, loss, eta, seed, time.time() - t0)


def reached(r: dict, threshold: float) -> tuple[int, float | None] | None:
    """(the first evaluation step with accuracy ≥ threshold, the trainer's seconds to it), or None."""
    curve = {int(k): v for k, v in r["curve"].items()}
    hit = next((s for s in sorted(curve) if curve[s] >= threshold), None)
    if hit is None:
        return None
    clock = {int(k): v for k, v in r.get("clock", {}).items()}
    return hit, clock.get(hit)


def rescan(root: Path, cells: list[tuple[str, int, int]], old: list[dict]) -> list[dict]:
    """The figures of every finished cell (its trainer wrote DONE) recomputed from its run root; the
    wall time is the one recorded when it ran."""
    from areal_core.store import Store

    wall = {(r["loss"], r["eta"], r["seed"]): r.get("wall_s", float("nan")) for r in old}
    out = []
    for loss, eta, seed in cells:
        path = root / cell_name(loss, eta, seed)
        if path.exists() and Store(str(path)).done():
            out.append(cell_result(Store(str(path)), loss, eta, seed, wall.get((loss, eta, seed), float("nan"))))
    return out


def _mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "–"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    by: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        by.setdefault((r["loss"], r["eta"]), []).append(r)
    etas = sorted({r["eta"] for r in results})
    thr = args.threshold
    lines = [
        f"{args.steps} RL steps per cell, lr {args.lr}, {args.rollout_workers} rollout worker(s), held-out accuracy on "
        f"{args.eval} problems every {args.eval_every} steps; mean ± sd over the seeds run.",
        "",
        "| η | " + " | ".join(f"{LABEL.get(loss, loss)} (final)" for loss in args.losses) + " |",
        "|---|" + "---|" * len(args.losses),
    ]
    for e in etas:
        cells = [_mean_sd([r["final"] for r in by.get((loss, e), [])]) for loss in args.losses]
        lines.append(f"| {eta_label(e)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| loss | η | seeds | final held-out | steps to ≥ {thr} | trainer s to ≥ {thr} | staleness mean / max "
        "| KL(behav‖prox) | w median min–max (extremes) | clip frac |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loss in args.losses:
        for e in etas:
            rs = by.get((loss, e), [])
            if not rs:
                continue
            hits = [h for h in (reached(r, thr) for r in rs) if h is not None]
            steps = f"{statistics.fmean(h[0] for h in hits):.0f}" if hits else "–"
            secs = [h[1] for h in hits if h[1] is not None]
            secs_s = f"{statistics.fmean(secs):.0f}" if secs else "–"
            w = (
                f"{median([r['w_min_median'] for r in rs]):.3g}–{median([r['w_max_median'] for r in rs]):.3g} "
                f"({min(r['w_min'] for r in rs):.3g}–{max(r['w_max'] for r in rs):.3g})"
            )
            if loss == "ppo":
                w = "– (no weight)"
            nan = " NaN" if any(r["non_finite"] for r in rs) else ""
            lines.append(
                f"| {LABEL.get(loss, loss)} | {eta_label(e)} | {len(rs)} | {_mean_sd([r['final'] for r in rs])}{nan} | "
                f"{steps} ({len(hits)}/{len(rs)} reached) | {secs_s} | "
                f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs)} | "
                f"{statistics.fmean(r['kl_behav_prox'] for r in rs):.2e} | {w} | "
                f"{statistics.fmean(r['clip_frac'] for r in rs):.4f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Final held-out accuracy against η (∞ at the right end), mean ± sd over seeds, one line per loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted({r["eta"] for r in results})
    xs = list(range(len(etas)))
    fig, ax = plt.subplots(figsize=(6, 4))
    for loss in args.losses:
        pts = [(x, [r["final"] for r in results if r["loss"] == loss and r["eta"] == e]) for x, e in zip(xs, etas)]
        pts = [(x, v) for x, v in pts if v]
        if not pts:
            continue
        mean = [statistics.fmean(v) for _, v in pts]
        sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in pts]
        ax.errorbar([x for x, _ in pts], mean, yerr=sd, marker="o", capsize=3, label=LABEL.get(loss, loss))
    ax.set_xticks(xs, [eta_label(e) for e in etas])
    ax.set_xlabel("staleness bound η")
    ax.set_ylabel(f"final held-out accuracy ({args.steps} steps)")
    ax.set_title("Staleness ablation: naive vs decoupled PPO")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(root: Path, results: list[dict], args: argparse.Namespace) -> str:
    import torch

    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n\n"
    )
    text = header + markdown(results, args)
    (root / "staleness_ablation.md").write_text(text)
    if results:
        plot(results, args, root / "staleness_ablation.png")
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--etas", nargs="+", default=ETAS, help="staleness bounds; 'inf' is η = ∞")
    parser.add_argument("--losses", nargs="+", default=LOSSES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval", type=int, default=500, help="held-out problems per evaluation")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out accuracy for time-to-accuracy")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--root", default="runs/staleness-ablation")
    parser.add_argument("--init", default="", help="an SFT checkpoint URI (default: train one under ROOT/sft)")
    parser.add_argument("--cell-timeout", type=float, default=4 * 3600)
    parser.add_argument(
        "--rescan", action="store_true", help="recompute the finished cells' figures from their run roots; run nothing"
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides for every cell")
    args = parser.parse_args()
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every (the final accuracy is the last evaluation)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from areal_core.logs import setup_logging

    setup_logging()
    base = [
        f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        f"eval.num_samples={args.eval}",
        f"train.lr={args.lr}",
        f"rollout.num_workers={args.rollout_workers}",
        "threads_per_role=1",
        "tracking.enabled=false",
        "launcher.progress=false",
        *args.overrides,
    ]
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results_path = root / "results.jsonl"
    lines = results_path.read_text().splitlines() if results_path.exists() else []
    results = [r for r in map(json.loads, filter(None, lines)) if "error" not in r]
    cells = [(loss, eta, seed) for seed in args.seeds for eta in map(eta_value, args.etas) for loss in args.losses]
    if args.rescan:
        results = rescan(root, cells, results)
        results_path.write_text("".join(json.dumps(r) + "\n" for r in results))
        print(write_outputs(root, results, args))
        return
    init = args.init or sft_checkpoint(str(root), ["tracking.enabled=false", "launcher.progress=false"])
    done = {(r["loss"], r["eta"], r["seed"]) for r in results}
    for loss, eta, seed in cells:
        if (loss, eta, seed) in done:
            continue
        try:
            r = run_cell(loss, eta, seed, args, base, init)
        except Exception as exc:  # record the failure and go on with the other cells
            r = {"loss": loss, "eta": eta, "seed": seed, "error": repr(exc)[:500]}
        with results_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print("RESULT", json.dumps(r), flush=True)
        if "error" not in r:
            results.append(r)
        write_outputs(root, results, args)
    print(write_outputs(root, results, args))


if __name__ == "__main__":
    main()
