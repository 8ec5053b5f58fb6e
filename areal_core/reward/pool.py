"""A process pool for reward functions: each call has a timeout that kills its process.

A call that raises, crashes its process or runs past `timeout_s` is retried up to
`retries` times, then scores 0 with the reason in `info["error"]`. A hung or crashing
sample never stalls the other samples.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from areal_core.procs import descendants, die_with_parent, kill_group
from areal_core.protocol import finite_reward
from areal_core.reward.signatures import load_functions, reward_spec

DEFAULT_REWARD = "areal_core.reward.math:gsm8k_reward"
# a task's own verifier, when reward.function is empty (every other task: DEFAULT_REWARD)
TASK_REWARDS = {
    "math": "areal_core.reward.math:math_reward",
    "dataset": "areal_core.reward.math:math_reward",
    "reasoning_gym": "task_data.reasoning_gym:gym_reward",
}


def reward_function(cfg: Any) -> str:
    """The spec of the run's reward (reward/signatures.py): reward.function with reward.weights,
    else its task's verifier."""
    return reward_spec(cfg, TASK_REWARDS.get(cfg.task.name, DEFAULT_REWARD))


@dataclass
class RewardResult:
    reward: float
    token_rewards: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def normalize(value: Any) -> RewardResult:
    """float | (float, info) | {"reward", "token_rewards"?, "info"?} -> RewardResult.

    A reward that is not finite in float32 (NaN, ±inf, 1e39) is an error of the reward
    function, never a training signal: the call fails and the pool scores it 0 with the reason.
    """
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, dict):
        result = RewardResult(float(value["reward"]), value.get("token_rewards"), dict(value.get("info", {})))
    elif isinstance(value, tuple):
        result = RewardResult(float(value[0]), None, dict(value[1]) if len(value) > 1 else {})
    else:
        result = RewardResult(float(value))
    if not finite_reward(result.reward) or not all(map(finite_reward, result.token_rewards or [])):
        raise ValueError(f"reward function returned a non-finite reward ({result.reward!r})")
    return result


class Grader:
    """A reward spec's functions (reward/signatures.py) as one call: job -> RewardResult.

    One function: its value normalised (`normalize`). Several: reward = Σ wᵢ·rᵢ over the ones
    that returned a number, each value in `info["rewards"]`; a TRL function's None leaves it out,
    and when every function returns None the result is skipped (reward 0, `info["skipped"]`)."""

    def __init__(self, spec: str):
        self.functions = load_functions(spec)

    def __call__(self, job: dict[str, Any]) -> RewardResult:
        if len(self.functions) == 1 and self.functions[0].weight == 1.0:
            f = self.functions[0]
            value = f(job)
            if value is None and f.kind == "trl":
                return RewardResult(0.0, None, {**f.logged, "skipped": True})
            result = normalize(value)
            result.info.update(f.logged)  # what a TRL function gave log_metric / log_extra
            return result
        values: dict[str, float | None] = {}
        info: dict[str, Any] = {}
        total, counted = 0.0, 0
        for f in self.functions:
            value = f(job)
            info.update(f.logged)
            if value is None and f.kind == "trl":
                values[f.name] = None
                continue
            result = normalize(value)
            if result.token_rewards is not None:
                raise ValueError(f"{f.path}: token rewards cannot be combined with other reward functions")
            values[f.name] = result.reward
            info.update({f"{f.name}/{k}": v for k, v in result.info.items()})
            total += f.weight * result.reward
            counted += 1
        info["rewards"] = values
        if not counted:
            return RewardResult(0.0, None, {**info, "skipped": True})
        if not finite_reward(total):
            raise ValueError(f"the weighted reward is not finite ({total!r})")
        return RewardResult(total, None, info)


def _worker_main(conn: Connection, fn_path: str, parent: int) -> None:
    die_with_parent(signal.SIGKILL, parent)  # a grader never outlives the process that owns the pool
    os.setpgid(0, 0)  # its own process group: a timeout kills what the reward function started too
    grader = Grader(fn_path)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        job, kwargs = msg
        try:
            conn.send((job, True, grader(kwargs)))
        except Exception as exc:  # reported to the parent, which decides on retries
            conn.send((job, False, f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=2)[-300:]}"))


class _Proc:
    def __init__(self, ctx: Any, fn_path: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fn_path, os.getpid()), daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        """SIGKILL the grader's process group and every process descended from it (the reward
        function's own children, those that left the group with setsid too)."""
        if self.proc.pid is not None:
            tree = descendants(self.proc.pid)  # before the kill: a killed parent's children are orphans
            kill_group(self.proc.pid, signal.SIGKILL)  # fails only if the group does not exist yet
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    def __init__(self, fn_path: str, size: int = 1, timeout_s: float = 5.0, retries: int = 1):
        Grader(fn_path)  # fail early, in the parent, with a clear message
        self.fn_path, self.size, self.timeout_s, self.retries = fn_path, size, timeout_s, retries
        self._ctx = mp.get_context("fork")
        self._procs = [_Proc(self._ctx, fn_path) for _ in range(size)]
        # failed: results that are a failure of the call (raised, timed out, crashed), after retries
        self.stats = {"calls": 0, "timeouts": 0, "errors": 0, "crashes": 0, "results": 0, "failed": 0}
        self.last_failure = ""

    def grade(self, jobs: list[dict[str, Any]]) -> list[RewardResult]:
        """Each job is the keyword arguments of one reward call; results keep the jobs' order."""
        results: list[RewardResult | None] = [None] * len(jobs)
        attempts = [0] * len(jobs)
        todo = deque(range(len(jobs)))
        idle = deque(self._procs)
        busy: dict[Connection, tuple[_Proc, int, float]] = {}

        def fail(i: int, reason: str) -> None:
            attempts[i] += 1
            if attempts[i] <= self.retries:
                todo.append(i)
            else:  # `failed` tells a failed call from a grader's own reason for a 0 (`error` alone)
                results[i] = RewardResult(0.0, None, {"error": reason, "failed": True})
                self.stats["failed"] += 1
                self.last_failure = reason

        while todo or busy:
            while todo and idle:
                proc, i = idle.popleft(), todo.popleft()
                proc.conn.send((i, jobs[i]))
                busy[proc.conn] = (proc, i, time.monotonic() + self.timeout_s)
                self.stats["calls"] += 1
            next_deadline = min(d for _, _, d in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                proc, i, _ = busy.pop(conn)
                try:
                    _, ok, payload = conn.recv()
                except (EOFError, OSError):
                    self.stats["crashes"] += 1
                    proc.kill()
                    idle.append(self._replace(proc))
                    fail(i, f"reward process died (exit code {proc.proc.exitcode})")
                    continue
                idle.append(proc)
                if ok:
                    results[i] = payload
                else:
                    self.stats["errors"] += 1
                    fail(i, payload)
            now = time.monotonic()
            for conn, (proc, i, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(conn)
                    self.stats["timeouts"] += 1
                    proc.kill()
                    idle.append(self._replace(proc))
                    fail(i, f"timeout after {self.timeout_s:g}s")
        self.stats["results"] += len(jobs)
        return [r for r in results if r is not None]

    def _replace(self, dead: _Proc) -> _Proc:
        fresh = _Proc(self._ctx, self.fn_path)
        self._procs[self._procs.index(dead)] = fresh
        return fresh

    def close(self) -> None:
        """Ask every grader to exit (2 s each), then kill the rest."""
        for p in self._procs:
            try:
                p.conn.send(None)
            except OSError:
                pass
            p.proc.join(timeout=2)
            if p.proc.is_alive():
                p.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # an error or a stop signal (SystemExit): the graders go now
            for p in self._procs:
                p.kill()
