"""AReaL's staleness ablation on our cores: PPO rules against the staleness bound η (issues 27 and 47).

    PYTHONPATH=. .venv/bin/python benchmarks/staleness_ablation.py [--setting faithful|job] \\
        [--rules naive mask5 uncapped trunc5] [--etas 0 2 8 inf] [--seeds 1 2 3] [--steps 800] \\
        [--eval-every 100] [--threshold 0.5] [--lr 1e-4] [--adv batch_norm|group_batch_norm] \\
        [--rollout-workers 1] [--root runs/staleness-faithful] [--init URI] [--quick] [overrides...]

Every cell (rule, η, seed) starts from one SFT checkpoint of the default job (`vs_trl.sft_checkpoint`,
trained once under ROOT/sft, or `--init`), runs the asynchronous pipeline (`--rollout-workers`
rollout, one reward and one trainer process, one thread each) on configs/default.yaml with the
setting's and the rule's overrides, `train.eta=<η>`, `train.lr=<lr>` and `seed=<seed>` for
`--steps` steps, the trainer evaluating greedy held-out accuracy every `--eval-every` steps.

The rules (`RULES`; the correction w = π_prox/π_behav is `algo.behav_correction`, docs/algorithms.md):

  naive     naive PPO: ratio to π_behav, no π_prox, no weight (`algo.loss=ppo`)
  mask5     decoupled PPO with AReaL's rule: tokens with w > 5 dropped, the rest weighted by w
            (AReaL's `behave_imp_weight_mode: token_mask` default until April 2026, and its
            examples' `rejection_sampling: {metric: ratio, upper: 5}`; tests/test_areal_reference.py)
  uncapped  decoupled PPO, w uncapped (AReaL's paper config)
  trunc5    decoupled PPO, w truncated at 5 (our default; AReaL's opt-in `action: clamp`)
  drop_pos  the mechanism control: uncapped, and the tokens with A > 0 and w > 1 + ε_high dropped
            (`algo.decoupled_ppo.behav_clip_drop=positive`: the half of naive PPO's clip that acts on
            stale gains)
  drop_both uncapped, and both halves dropped (A < 0 with w < 1 − ε_low too): with one minibatch
            naive PPO's gradient exactly (tests/test_clip_drop.py)
  ppo, decoupled_ppo   the issue-27 cells: naive PPO and decoupled PPO with w truncated at 5 (the default
            until issue 47), ε as the setting has it (0.2 / 0.28 in the job setting)

At η = 0 every rule is the same update up to the engine's and the trainer's log-prob rounding
(π_behav = π_prox, w = 1), so η = 0 runs once per seed, under the first rule, and stands for all.

The settings (`SETTINGS`):

  faithful  issue 47's: B = 32 groups × 8 a step, `train.ppo_minibatches=4` (each minibatch 8 groups,
            today's whole batch), ε = 0.2 both sides, token-mean, π_prox recomputed before the
            minibatches, advantages as AReaL normalises them (`--adv`: `batch_norm`, its paper:
            the reward over the batch, no group baseline; `group_batch_norm`, its GSM8K example).
            The learning rate is `--lr` (1e-4 by default, a placeholder: the issue asks for the
            rate at which sync with 4 minibatches learns no worse than with 1, found by a sweep,
            docs/benchmarks.md gives its commands).
  job       issue 27's: the default job (B = 8 × 8, one minibatch, GRPO advantages), lr 3e-4 there.

Per cell, from trainer/metrics.jsonl and the trainer's events:

- final held-out accuracy (the evaluation at the last step) and the curve;
- time to accuracy: the first evaluation step reaching `--threshold`, and the trainer's wall time
  to it (its "trained" event, minus the time spent in the earlier evaluations);
- the staleness actually trained (versions behind, mean and max), KL(behaviour‖proximal) (the mean
  over steps of mean_t (log π_behav − log π_prox));
- the share of policy tokens the correction masked (`behav_masked_frac` − `behav_nonfinite_frac`)
  or truncated (`behav_truncated_frac`), or dropped by `algo.decoupled_ppo.behav_clip_drop`, means over
  steps; the importance-weight range (median over steps of the per-step smallest and largest w and its
  extremes); the clip fraction, all and split by the sign of A; the sampled tokens' entropy
  (mean −log π_behav, `sampled_entropy`) over the first and the last 10 steps.

η = ∞ is `train.eta=1000000` (`INF`): at that value admission, (v + η + 1)·B groups, never binds.
Staleness is real only where the rollout is ahead: with the trainer the bottleneck (this tiny job
on 2 cores) samples are η versions old; on a machine where it is not, raise `--rollout-workers`.

Cells run seed by seed, each result appended to ROOT/results.jsonl at once; a rerun skips finished
cells and restarts unfinished ones; `--rescan` recomputes the figures from the run roots. The
Markdown tables go to ROOT/staleness_ablation.md and stdout, the plot (accuracy against η per rule,
and against the measured KL per cell) to ROOT/staleness_ablation.png. `--quick` is a smoke run of
the whole path (every rule at η ∈ {0, 4}, one seed, a few steps of a small batch, a short SFT):
it shows the script works, not a result.
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
DECOUPLED = "algo.loss=decoupled_ppo"
FAITHFUL_RULES = ["mask5", "naive", "uncapped", "trunc5"]
RULES: dict[str, tuple[str, list[str]]] = {
    "naive": ("naive PPO", ["algo.loss=ppo"]),
    "mask5": ("decoupled, AReaL's mask w > 5", [DECOUPLED, "algo.behav_correction=mask", "algo.behav_high=5.0"]),
    "uncapped": ("decoupled, w uncapped", [DECOUPLED, "algo.behav_correction=truncate", "algo.behav_high=0"]),
    "trunc5": ("decoupled, w truncated at 5", [DECOUPLED, "algo.behav_correction=truncate", "algo.behav_high=5.0"]),
    "drop_pos": (
        "decoupled uncapped, drop A > 0 with w > 1 + ε",
        [
            DECOUPLED,
            "algo.behav_correction=truncate",
            "algo.behav_high=0",
            "algo.decoupled_ppo.behav_clip_drop=positive",
        ],
    ),
    "drop_both": (
        "decoupled uncapped, drop what naive PPO clips",
        [DECOUPLED, "algo.behav_correction=truncate", "algo.behav_high=0", "algo.decoupled_ppo.behav_clip_drop=both"],
    ),
    "ppo": ("naive PPO", ["algo.loss=ppo"]),
    "decoupled_ppo": ("decoupled PPO", [DECOUPLED, "algo.behav_correction=truncate", "algo.behav_high=5.0"]),
}
LABEL = {name: label for name, (label, _) in RULES.items()}
SETTINGS: dict[str, list[str]] = {
    "faithful": [
        "train.batch_groups=32",
        "rollout.group_size=8",
        "train.ppo_minibatches=4",
        "algo.eps_low=0.2",
        "algo.eps_high=0.2",
        "algo.aggregation=token_mean",
        "algo.behav_low=0",
    ],
    "job": [],
}
QUICK = {"steps": 4, "eval_every": 2, "eval": 20, "etas": ["0", "4"], "seeds": [1]}
QUICK_OVERRIDES = ["train.batch_groups=8", "sft.steps=20", "train.lr_warmup_steps=1", "eval.num_samples=20"]


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
    mean = lambda key: statistics.fmean(pick(key)) if pick(key) else float("nan")  # noqa: E731
    return {
        "loss": loss,
        "eta": eta,
        "seed": seed,
        "final": curve[max(curve)] if curve else float("nan"),
        "curve": curve,
        "clock": {s: clock.get(s) for s in curve},
        "train_s": clock.get(max(clock)) if clock else None,
        "wall_s": wall_s,
        "kl_behav_prox": mean("kl_behav_prox"),
        "w_min_median": median(pick("importance_weight_min")),
        "w_max_median": median(pick("importance_weight_max")),
        "w_min": min(pick("importance_weight_min"), default=float("nan")),
        "w_max": max(pick("importance_weight_max"), default=float("nan")),
        "clip_frac": mean("clip_frac"),
        "masked_frac": max(0.0, mean("behav_masked_frac") - mean("behav_nonfinite_frac")),
        "truncated_frac": mean("behav_truncated_frac"),
        "staleness_max": max(pick("staleness_max"), default=0),
        "clip_frac_adv_pos": mean("clip_frac_adv_pos"),
        "clip_frac_adv_neg": mean("clip_frac_adv_neg"),
        "dropped_frac": mean("behav_clip_dropped_frac"),
        "entropy_first": statistics.fmean(pick("sampled_entropy")[:10]) if pick("sampled_entropy") else float("nan"),
        "entropy_last": statistics.fmean(pick("sampled_entropy")[-10:]) if pick("sampled_entropy") else float("nan"),
        **summarise_metrics(store),
    }


def run_cell(loss: str, eta: int, seed: int, args: argparse.Namespace, base: list[str], init: str) -> dict:
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    root = Path(args.root) / cell_name(loss, eta, seed)
    if root.exists():  # an unfinished cell of an interrupted invocation: start it again
        shutil.rmtree(root)
    overrides = [*base, *RULES[loss][1], f"train.eta={eta}", f"seed={seed}", f"store={root}"]
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


def mean_sd(xs: list[float], digits: int = 3) -> str:
    """ "mean ± sd" of the finite values ("–" when none; the value alone when one)."""
    xs = [x for x in xs if x == x]
    if not xs:
        return "–"
    sd = f" ± {statistics.stdev(xs):.{digits}f}" if len(xs) > 1 else ""
    return f"{statistics.fmean(xs):.{digits}f}{sd}"


def read_results(path: Path) -> list[dict]:
    """The finished cells recorded in a results.jsonl (the failed ones, with "error", left out)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if "error" not in r]


def cells_of(by: dict[tuple[str, int], list[dict]], rule: str, eta: int, rules: list[str]) -> list[dict]:
    """The results of (rule, η); at η = 0 the first rule's when this rule has none of its own (η = 0 runs once)."""
    return by.get((rule, eta)) or (by.get((rules[0], 0), []) if eta == 0 else [])


def setting_line(args: argparse.Namespace) -> str:
    what = {
        "faithful": f"B = 32 groups × 8, 4 minibatches, ε = 0.2 both sides, token-mean, advantages `{args.adv}`",
        "job": "the default job (B = 8 × 8, one minibatch, GRPO advantages, ε = 0.2 / 0.28)",
    }[args.setting]
    extra = f"; then the overrides {' '.join(args.overrides)} (they win)" if args.overrides else ""
    return (
        f"Setting `{args.setting}`: {what}{extra}. {args.steps} RL steps per cell, lr {args.lr}, "
        f"{args.rollout_workers} rollout worker(s), held-out accuracy on {args.eval} problems every "
        f"{args.eval_every} steps; mean ± sd over the seeds run. η = 0 ran once, under "
        f"{LABEL.get(args.rules[0], args.rules[0])}: every rule is the same update there."
    )


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    by: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        by.setdefault((r["loss"], r["eta"]), []).append(r)
    etas = sorted({r["eta"] for r in results})
    thr, rules = args.threshold, args.rules
    lines = [
        setting_line(args),
        "",
        "| η | " + " | ".join(f"{LABEL.get(rule, rule)} (final)" for rule in rules) + " |",
        "|---|" + "---|" * len(rules),
    ]
    for e in etas:
        cells = [mean_sd([r["final"] for r in cells_of(by, rule, e, rules)]) for rule in rules]
        lines.append(f"| {eta_label(e)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| rule | η | seeds | final held-out | steps to ≥ {thr} | trainer s to ≥ {thr} | staleness mean / max "
        "| KL(behav‖prox) | masked / truncated / dropped tokens | w median min–max (extremes) "
        "| clip frac (A > 0 / A < 0) | entropy first → last 10 steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rule in rules:
        for e in etas:
            rs = by.get((rule, e), [])
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
            if rule in ("ppo", "naive"):
                w = "– (no weight)"
            masked = statistics.fmean(r.get("masked_frac", float("nan")) for r in rs)
            truncated = statistics.fmean(r.get("truncated_frac", float("nan")) for r in rs)
            dropped = statistics.fmean(r.get("dropped_frac", float("nan")) for r in rs)
            dropped = 0.0 if dropped != dropped else dropped  # cells run before the control existed
            f = lambda key, rs=rs: statistics.fmean(r.get(key, float("nan")) for r in rs)  # noqa: E731
            nan = " NaN" if any(r["non_finite"] for r in rs) else ""
            label = LABEL.get(rule, rule) + (" (η = 0: every rule)" if e == 0 else "")
            lines.append(
                f"| {label} | {eta_label(e)} | {len(rs)} | {mean_sd([r['final'] for r in rs])}{nan} | "
                f"{steps} ({len(hits)}/{len(rs)} reached) | {secs_s} | "
                f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs)} | "
                f"{statistics.fmean(r['kl_behav_prox'] for r in rs):.2e} | "
                f"{masked:.2%} / {truncated:.2%} / {dropped:.2%} | {w} | "
                f"{f('clip_frac'):.4f} ({f('clip_frac_adv_pos'):.4f} / {f('clip_frac_adv_neg'):.4f}) | "
                f"{f('entropy_first'):.3f} → {f('entropy_last'):.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Final held-out accuracy against η (∞ at the right end), mean ± sd over seeds, one line per rule;
    and every cell's final accuracy against its measured KL(behav‖prox)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        by.setdefault((r["loss"], r["eta"]), []).append(r)
    etas = sorted({r["eta"] for r in results})
    xs = list(range(len(etas)))
    fig, (ax, kx) = plt.subplots(1, 2, figsize=(11, 4))
    for rule in args.rules:
        pts = [(x, [r["final"] for r in cells_of(by, rule, e, args.rules)]) for x, e in zip(xs, etas)]
        pts = [(x, v) for x, v in pts if v]
        if not pts:
            continue
        mean = [statistics.fmean(v) for _, v in pts]
        sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in pts]
        ax.errorbar([x for x, _ in pts], mean, yerr=sd, marker="o", capsize=3, label=LABEL.get(rule, rule))
        cells = [r for e in etas if e > 0 for r in by.get((rule, e), [])]
        kx.scatter([max(r["kl_behav_prox"], 1e-6) for r in cells], [r["final"] for r in cells], label=LABEL[rule])
    ax.set_xticks(xs, [eta_label(e) for e in etas])
    ax.set_xlabel("staleness bound η")
    ax.set_ylabel(f"final held-out accuracy ({args.steps} steps)")
    ax.set_title(f"accuracy against η ({args.setting} setting)")
    if any(r["eta"] > 0 for r in results):
        kx.set_xscale("log")
    kx.set_xlabel("measured KL(behav‖prox) per token (cell mean)")
    kx.set_title("accuracy against the measured staleness, per cell")
    for a in (ax, kx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="faithful")
    parser.add_argument("--rules", "--losses", dest="rules", nargs="+", choices=sorted(RULES), default=None)
    parser.add_argument("--etas", nargs="+", default=ETAS, help="staleness bounds; 'inf' is η = ∞")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval", type=int, default=500, help="held-out problems per evaluation")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out accuracy for time-to-accuracy")
    parser.add_argument("--lr", type=float, default=None, help="faithful: 1e-4 (a placeholder), job: 3e-4")
    parser.add_argument("--adv", choices=["batch_norm", "group_batch_norm"], default="batch_norm")
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--root", default=None, help="default runs/staleness-<setting> (runs/staleness-quick)")
    parser.add_argument("--init", default="", help="an SFT checkpoint URI (default: train one under ROOT/sft)")
    parser.add_argument("--cell-timeout", type=float, default=4 * 3600)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every rule (module docstring)")
    parser.add_argument(
        "--rescan", action="store_true", help="recompute the finished cells' figures from their run roots; run nothing"
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides for every cell")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.eval = QUICK["steps"], QUICK["eval_every"], QUICK["eval"]
        args.etas, args.seeds = QUICK["etas"], QUICK["seeds"]
        args.overrides = [*QUICK_OVERRIDES, *args.overrides]
    args.rules = args.rules or (["ppo", "decoupled_ppo"] if args.setting == "job" else FAITHFUL_RULES)
    args.lr = args.lr if args.lr is not None else (3e-4 if args.setting == "job" else 1e-4)
    args.root = args.root or ("runs/staleness-quick" if args.quick else f"runs/staleness-{args.setting}")
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every (the final accuracy is the last evaluation)")
    return args


def overrides_of(args: argparse.Namespace) -> list[str]:
    """Every cell's overrides: the run's cadence, the setting's, then `overrides` (the last one wins)."""
    adv = [f"algo.adv_estimator={args.adv}"] if args.setting == "faithful" else []
    return [
        f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        f"eval.num_samples={args.eval}",
        f"train.lr={args.lr}",
        f"rollout.num_workers={args.rollout_workers}",
        "threads_per_role=1",
        "tracking.enabled=false",
        "launcher.progress=false",
        *SETTINGS[args.setting],
        *adv,
        *args.overrides,
    ]


def plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(rule, η, seed) of every cell, seed by seed; η = 0 under the first rule only."""
    return [
        (rule, eta, seed)
        for seed in args.seeds
        for eta in map(eta_value, args.etas)
        for rule in (args.rules[:1] if eta == 0 else args.rules)
    ]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from areal_core.logs import setup_logging

    setup_logging()
    base = overrides_of(args)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results_path = root / "results.jsonl"
    results = read_results(results_path)
    cells = plan(args)
    if args.rescan:
        results = rescan(root, cells, results)
        results_path.write_text("".join(json.dumps(r) + "\n" for r in results))
        print(write_outputs(root, results, args))
        return
    sft_overrides = ["tracking.enabled=false", "launcher.progress=false", *(QUICK_OVERRIDES if args.quick else [])]
    init = args.init or sft_checkpoint(str(root), sft_overrides)
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
