"""Reward service throughput: math grades/s, sandboxed code grades/s, sandbox overhead per run.

    PYTHONPATH=. python benchmarks/reward_bench.py [--pool-size 2] [--code-rounds 2] [--runs 40]

* math: `gsm8k_reward` over the GSM8K test set (each reference against itself and against
  the previous question's answer), in-process and through a RewardPool of `--pool-size`
  processes (the reward worker's path); `math_reward` (math-verify) on a subset; process
  rewards (`process_reward`) on the same references.
* code: `code_reward` through a RewardPool on every code task's canonical solution
  (`--code-rounds` times), each completion's tests run 2 at a time in the sandbox.
* overhead: the same trivial program run `--runs` times as a bare `python3 -I -S -B`
  subprocess and in the sandbox; median and mean per run.

Prints a JSON summary and the Markdown table rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_core.reward.math import gsm8k_reward, math_reward  # noqa: E402
from areal_core.reward.pool import RewardPool  # noqa: E402
from areal_core.reward.process import process_reward  # noqa: E402
from areal_core.reward.sandbox import Sandbox  # noqa: E402
from task_data import code_tasks  # noqa: E402

GSM8K = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test.jsonl"


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def bench_math(pool_size: int) -> dict:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line]
    pairs = [(r["answer"], r["answer"]) for r in rows] + [
        (rows[i - 1]["answer"], rows[i]["answer"]) for i in range(len(rows))
    ]
    t0 = time.perf_counter()
    scores = [gsm8k_reward(c, ref) for c, ref in pairs]
    inproc = time.perf_counter() - t0
    jobs = [{"completion": c, "reference": ref} for c, ref in pairs]
    with RewardPool("areal_core.reward.math:gsm8k_reward", size=pool_size, timeout_s=10) as pool:
        pool.grade(jobs[:pool_size])  # warm
        t0 = time.perf_counter()
        pooled = pool.grade(jobs)
        pool_s = time.perf_counter() - t0
    assert [r.reward for r in pooled] == scores
    subset = [
        (f"The answer is $\\boxed{{{r['answer'].rsplit('####', 1)[1].strip()}}}$", r["answer"]) for r in rows[:200]
    ]
    math_reward(*subset[0])  # import math-verify outside the timing
    t0 = time.perf_counter()
    mv = [math_reward(c, ref) for c, ref in subset]
    mv_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in rows:
        process_reward(r["answer"], r["answer"])
    prm_s = time.perf_counter() - t0
    return {
        "gsm8k_grades": len(pairs),
        "gsm8k_correct_self": sum(scores[: len(rows)]),
        "gsm8k_inprocess_per_s": rate(len(pairs), inproc),
        "gsm8k_pool_per_s": rate(len(pairs), pool_s),
        "math_verify_grades": len(subset),
        "math_verify_correct": sum(mv),
        "math_verify_per_s": rate(len(subset), mv_s),
        "process_reward_per_s": rate(len(rows), prm_s),
    }


def bench_code(pool_size: int, rounds: int) -> dict:
    tasks = code_tasks.TASKS * rounds
    jobs = [
        {"completion": f"```python\n{t['solution']}```", "reference": json.dumps({"tests": t["tests"]})} for t in tasks
    ]
    n_tests = sum(len(t["tests"]) for t in tasks)
    with RewardPool("areal_core.reward.code:code_reward", size=pool_size, timeout_s=60, retries=0) as pool:
        pool.grade(jobs[:pool_size])  # warm: builds and probes the sandbox in each process
        t0 = time.perf_counter()
        results = pool.grade(jobs)
        took = time.perf_counter() - t0
    assert all(r.reward == 1.0 for r in results), [r.info for r in results if r.reward != 1.0]
    return {
        "code_completions": len(jobs),
        "code_tests": n_tests,
        "code_grades_per_s": rate(len(jobs), took),
        "code_tests_per_s": rate(n_tests, took),
        "code_pool_size": pool_size,
        "code_parallel_tests": 2,
    }


def bench_overhead(runs: int) -> dict:
    program = "print(sum(range(1000)))\n"
    sb = Sandbox()
    work = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    (work / "main.py").write_text(program)
    bare, boxed = [], []
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            out = subprocess.run(
                [sb.python, "-I", "-S", "-B", str(work / "main.py")], capture_output=True, text=True, timeout=30
            )
            bare.append(time.perf_counter() - t0)
            assert out.stdout.strip() == "499500"
            t0 = time.perf_counter()
            res = sb.run(program)
            boxed.append(time.perf_counter() - t0)
            assert res.ok and res.stdout.strip() == "499500", res
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {
        "runs": runs,
        "bare_median_ms": ms(bare),
        "bare_mean_ms": 1000 * statistics.mean(bare),
        "sandbox_median_ms": ms(boxed),
        "sandbox_mean_ms": 1000 * statistics.mean(boxed),
        "overhead_median_ms": ms(boxed) - ms(bare),
    }


def machine() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} vCPU {model}, Python {platform.python_version()}, {bwrap}, "
        f"kernel {platform.release()}, load average at start {load}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--code-rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    out = {"machine": machine()}
    out.update(bench_math(args.pool_size))
    out.update(bench_code(args.pool_size, args.code_rounds))
    out.update(bench_overhead(args.runs))
    print(json.dumps(out, indent=1))
    print()
    print("| what | rate / time |")
    print("|---|---|")
    print(f"| gsm8k_reward, in process | {out['gsm8k_inprocess_per_s']:,.0f} grades/s |")
    print(f"| gsm8k_reward, RewardPool of {args.pool_size} | {out['gsm8k_pool_per_s']:,.0f} grades/s |")
    print(f"| math_reward (math-verify), in process | {out['math_verify_per_s']:,.0f} grades/s |")
    print(f"| process_reward (steps + outcome), in process | {out['process_reward_per_s']:,.0f} grades/s |")
    print(
        f"| code_reward, sandboxed, RewardPool of {args.pool_size} × 2 tests at once | "
        f"{out['code_grades_per_s']:.2f} completions/s ({out['code_tests_per_s']:.1f} tests/s) |"
    )
    print(f"| bare `python3 -I -S` run | {out['bare_median_ms']:.0f} ms median |")
    print(f"| same run in the sandbox | {out['sandbox_median_ms']:.0f} ms median |")
    print(f"| sandbox overhead per run | {out['overhead_median_ms']:.0f} ms |")


if __name__ == "__main__":
    main()
