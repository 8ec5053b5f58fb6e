"""Idle cores (issue 57): the default job with and without a change, paired and interleaved on one machine.

    PYTHONPATH=. .venv/bin/python benchmarks/idle_cores.py [--steps 300] [--seeds 1 2 3] [--skip 10]
        [--old COMMIT | --old-set KEY=VALUE ...] [--new-set KEY=VALUE ...] [--root runs/idle-cores] [overrides...]

Each seed runs the default job (configs/default.yaml, from one SFT checkpoint, trained once under ROOT/sft,
held-out evaluations off) twice in a row, "old" then "new": one rollout, one reward and one trainer process
as `make run` starts them (benchmarks/step_profile.py). "old" is this tree with the `--old-set KEY=VALUE`
overrides (default `train.background_publish=false`) or, with `--old COMMIT`, that commit's code (a `git worktree`
under ROOT/old-COMMIT); "new" is this tree as configured, with the `--new-set KEY=VALUE` overrides. Per run, from
the trainer's step `--skip` to the end:
  - wall s/step; CPU-s/step of the three role processes with their children (wait4's rusage); CPU-s/step ÷ the
    cores this process may run on, and wall ÷ that (1.00: no core idle; the target is ≤ 1.10);
  - the doctor's shares since RL began (areal_core/report/timing.py: role_time): the trainer's busy share, rollout's
    wait on admission, reward's wait;
  - the 1-minute load average before and after (others' jobs on the machine inflate wall, not our CPU-s).
Prints one row per run, then the mean per variant; writes ROOT/idle_cores.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BASE = ["tracking.enabled=false", "launcher.progress=false", "train.eval_every=0"]


def one_run(root: str, init: str, steps: int, seed: int, skip: int, overrides: list[str]) -> dict:
    """One run of the default job with the code on sys.path (this tree or an old one): figures as a dict."""
    from areal_core.events import read_events
    from areal_core.report.doctor import rl_start
    from areal_core.report.timing import role_time
    from areal_core.run import pipeline
    from areal_core.store import Store
    from benchmarks.step_profile import run

    load0 = os.getloadavg()[0]
    args = [*BASE, f"train.steps={steps}", f"seed={seed}", f"store={root}", *overrides]
    uri, _ = pipeline.prepare("configs/default.yaml", args)
    store = Store(uri)
    pipeline.ensure_init_model(store, init)
    wall, cpu, skipped = run(uri, None, skip)
    n = steps - skipped
    records = read_events(store)
    roles = role_time(records, since=rl_start(records))
    cores = len(os.sched_getaffinity(0))
    cpu_step = sum(cpu.values()) / n

    def share(role: str, what: str) -> float:
        r = roles.get(role)
        if r is None:
            return float("nan")
        return r.busy if what == "busy" else r.wait_on.get(what, 0.0) if what != "wait" else r.wait

    return {
        "wall_step": wall / n,
        "cpu_step": cpu_step,
        "cpu_per_core": cpu_step / cores,
        "idle_ratio": (wall / n) / (cpu_step / cores),
        "cpu_roles": {r: c / n for r, c in cpu.items()},
        "trainer_busy": share("trainer", "busy"),
        "rollout_admission_wait": share("rollout", "admission"),
        "reward_wait": share("reward", "wait"),
        "cores": cores,
        "load": [load0, os.getloadavg()[0]],
    }


def sft_init(root: Path) -> str:
    """The default job's SFT checkpoint under ROOT/sft (trained once, reused while committed)."""
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.store import Store

    store = Store(str(root / "sft"))
    if store.exists(LAYOUT.committed(LAYOUT.init_model)):
        return store.url(LAYOUT.init_model)
    uri, _ = pipeline.prepare("configs/default.yaml", [*BASE, f"store={root / 'sft'}"])
    return pipeline.sft(uri)


def old_tree(root: Path, commit: str) -> Path:
    """A git worktree of `commit` under ROOT (made once)."""
    tree = root / f"old-{commit[:12]}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(tree), commit], check=True)
    return tree


def run_in(tree: Path, root: Path, name: str, init: str, args: argparse.Namespace, seed: int, extra: list[str]) -> dict:
    """One run in its own process, importing `tree`'s code (the roles it starts run that code too)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--init", init, "--steps", str(args.steps)]
    cmd += ["--skip", str(args.skip), "--seeds", str(seed), "--root", str(root / f"{name}-s{seed}"), *extra]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=str(tree), env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(name: str, seed: int, r: dict) -> str:
    return (
        f"| {name} | {seed} | {r['wall_step']:.3f} | {r['cpu_step']:.3f} | {r['cpu_per_core']:.3f} | "
        f"{r['idle_ratio']:.2f} | {r['trainer_busy']:.0%} | {r['rollout_admission_wait']:.0%} | "
        f"{r['reward_wait']:.0%} | {r['load'][0]:.1f}→{r['load'][1]:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the figures (start-up)")
    parser.add_argument("--old", default="", help="a commit to compare with (default: this tree with --old-set)")
    parser.add_argument("--old-set", action="append", help="an override of the old runs of this tree (repeatable)")
    parser.add_argument("--new-set", action="append", help="an override of the new runs only (repeatable)")
    parser.add_argument("--new-first", action="store_true", help="run new before old in each seed (order effects)")
    parser.add_argument("--root", default="runs/idle-cores")
    parser.add_argument("--init", default="", help="an SFT checkpoint (default: trained once under ROOT/sft)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.one:
        figures = one_run(args.root, args.init, args.steps, args.seeds[0], args.skip, args.overrides)
        print(json.dumps(figures))
        return
    root = Path(args.root).resolve()
    init = (os.path.abspath(args.init) if "://" not in args.init else args.init) if args.init else sft_init(root)
    old = (old_tree(root, args.old), []) if args.old else (HERE, args.old_set or ["train.background_publish=false"])
    variants = {"old": old, "new": (HERE, args.new_set or [])}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    print(
        "| code | seed | wall s/step | CPU-s/step | CPU-s/step ÷ cores | wall ÷ that | trainer busy "
        "| rollout waits on admission | reward waits | load 1 min |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for name in ["new", "old"] if args.new_first else ["old", "new"]:  # interleaved: old, new, old, new
            tree, extra = variants[name]
            r = run_in(tree, root, name, init, args, seed, [*extra, *args.overrides])
            results[name].append(r)
            print(row(name, seed, r), flush=True)
    for name, rs in results.items():
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("wall_step", "cpu_step", "cpu_per_core", "idle_ratio")}
        mean |= {k: sum(r[k] for r in rs) / len(rs) for k in ("trainer_busy", "rollout_admission_wait", "reward_wait")}
        print(row(f"{name} (mean)", len(rs), {**mean, "load": [rs[0]["load"][0], rs[-1]["load"][1]]}))
    (root / "idle_cores.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
