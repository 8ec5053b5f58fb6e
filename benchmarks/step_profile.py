"""Where a step's time goes, per role, on the default job from an SFT checkpoint (issue 17).

    python benchmarks/step_profile.py [--steps 100] [--init runs/vs-trl/sft/init_model]
                                      [--cprofile DIR] [overrides...]

Runs one rollout, one reward and one trainer process like `make run` (the SFT checkpoint is
trained first when --init is missing) and prints:
  - CPU seconds per step of each role process (with its children, e.g. the reward pool), read
    from /proc while the run goes, and the wall seconds per step of the run;
  - the per-step phases of each role (`areal_core/events.py` `phases` records), mean seconds
    per step, when the roles write them;
  - the trainer's own timing metrics (train_s, publish_s, ...) averaged over the steps;
  - with STEP_PROFILE_NICE=trainer=5,reward=5 in the environment: those roles start at that niceness (an
    experiment: the rollout, the critical path of a rollout-bound job, then wins the cores; docs/benchmarks.md);
  - with --cprofile DIR: each role runs under cProfile (DIR/{role}.prof) and its top functions
    by own time are printed (cProfile slows Python-heavy code: use it to find, not to measure).
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

from areal_core.events import read_events
from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.run import pipeline
from areal_core.run.launcher import PROJECT_ROOT
from areal_core.store import Store

ROLES = ("trainer", "rollout", "reward")


def start(role: str, uri: str, prof_dir: Path | None, log_dir: Path, index: int = 0) -> subprocess.Popen:
    name = role if index == 0 else f"{role}-{index}"
    cmd = [sys.executable]
    if prof_dir is not None:
        cmd += ["-m", "cProfile", "-o", str(prof_dir / f"{name}.prof")]
    cmd += ["-m", "areal_core.run.roles", role, "--run-uri", uri, "--index", str(index)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PYTHONUNBUFFERED": "1"}
    nice = dict(kv.split("=") for kv in os.environ.get("STEP_PROFILE_NICE", "").split(",") if kv).get(role)
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=str(PROJECT_ROOT),
        stdout=subprocess.DEVNULL,
        stderr=(log_dir / f"{name}.log").open("w"),
        preexec_fn=(lambda: os.nice(int(nice))) if nice else None,
    )


def workers(uri: str) -> list[tuple[str, int]]:
    """(role, index) of every process the run's config asks for: one trainer, rollout.num_workers rollout workers
    and reward.num_workers reward workers."""
    from areal_core.context import load_run_config

    cfg = load_run_config(Store(uri))
    n = {"trainer": 1, "rollout": cfg.rollout.num_workers, "reward": cfg.reward.num_workers}
    return [(role, i) for role in ROLES for i in range(n[role])]


def cpu_now(pid: int) -> float:
    """User + system CPU of a live process and of its live children."""
    proc = psutil.Process(pid)
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def run(uri: str, prof_dir: Path | None, skip: int, timeout_s: float = 3600) -> tuple[float, dict[str, float], int]:
    """Run the three roles to DONE (as many rollout and reward workers as the config asks for). Returns (wall s,
    CPU s per role, its workers summed, steps measured): from the trainer's heartbeat at step `skip` (start-up and
    the first steps left out) to the end (the processes' own and their children's CPU, from wait4's rusage at
    exit)."""
    log_dir = Path(uri.removeprefix("file://")).resolve().parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {(role, i): start(role, uri, prof_dir, log_dir, i) for role, i in workers(uri)}
    store = Store(uri)
    cpu: dict[str, float] = {}
    base: dict[str, float] | None = None
    base_step, t_base = 0, time.time()
    t0 = time.time()
    try:
        while len(cpu) < len(procs):
            if base is None:
                try:
                    base_step = int(store.read_json(LAYOUT.status("trainer", "0")).get("step", 0))
                except Exception:
                    base_step = 0
                if base_step >= skip:
                    base, t_base = {r: cpu_now(p.pid) for r, p in procs.items()}, time.time()
            for role, p in procs.items():
                if role in cpu:
                    continue
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid == 0:
                    continue
                p.returncode = os.waitstatus_to_exitcode(status)
                cpu[role] = ru.ru_utime + ru.ru_stime
                if p.returncode != 0:
                    log = (log_dir / f"{role[0] if role[1] == 0 else '-'.join(map(str, role))}.log").read_text()[-3000:]
                    raise RuntimeError(f"{role} exited {p.returncode}: {log}")
            if time.time() - t0 > timeout_s:
                raise TimeoutError("run did not finish")
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                p.wait()
    base = base or dict.fromkeys(procs, 0.0)
    return time.time() - t_base, {r: sum(cpu[k] - base[k] for k in procs if k[0] == r) for r in ROLES}, base_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--init", default="runs/vs-trl/sft/init_model")
    parser.add_argument("--root", default="runs/step-profile")
    parser.add_argument("--cprofile", default="")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the CPU and wall figures")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    setup_logging()
    base = ["tracking.enabled=false", "launcher.progress=false", "train.eval_every=0", f"train.steps={args.steps}"]
    init = os.path.abspath(args.init)
    if not Store(os.path.dirname(init)).exists(LAYOUT.committed(os.path.basename(init))):
        sft_uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"store={args.root}/sft"])
        init = pipeline.sft(sft_uri)
    uri, _ = pipeline.prepare("configs/default.yaml", [*base, f"store={args.root}/run", *args.overrides])
    store = Store(uri)
    pipeline.ensure_init_model(store, init)
    prof_dir = Path(args.cprofile).resolve() if args.cprofile else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    wall, cpu, skipped = run(uri, prof_dir, args.skip)
    n = args.steps - skipped
    print(f"\nsteps {skipped + 1}..{args.steps}: wall {wall:.1f} s ({wall / n:.3f} s/step)")
    print("CPU s/step: " + ", ".join(f"{r} {cpu[r] / n:.3f}" for r in ROLES) + f", total {sum(cpu.values()) / n:.3f}")
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for rec in read_events(store):
        if rec["kind"] == "phases" and rec.get("step", skipped) >= skipped:
            for name, s in rec["phases"].items():
                phases[rec["role"]][name] += s
    for role, ph in sorted(phases.items()):
        print(
            f"{role} phases, s/step: "
            + ", ".join(f"{k} {v / n:.4f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1]))
        )
    rows = [r for r in pipeline.metrics_rows(store) if r["step"] > skipped]
    keys = [k for k in ("train_s", "publish_s", "tokens_per_s", "response_tokens") if rows and k in rows[-1]]
    print(
        "trainer metrics (mean): "
        + ", ".join(f"{k} {sum(r.get(k, 0) for r in rows) / max(len(rows), 1):.4f}" for k in keys)
    )
    if prof_dir:
        for role in ROLES:
            print(f"\n== {role}: top functions by own time (cProfile)")
            pstats.Stats(str(prof_dir / f"{role}.prof")).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
