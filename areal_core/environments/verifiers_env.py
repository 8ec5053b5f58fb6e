"""verifiers 0.4 environments (`import verifiers.v1 as vf`: a taskset, its toolsets, a harness), run as
they are: `rollout.environment=verifiers:<taskset id or import path>[?key=value&...]` (docs/environments.md).

verifiers pins mcp==2.0.0 and openai<3, so it lives in its own venv (`.venv-verifiers`,
scripts/setup_verifiers_venv.sh; `$AREAL_VERIFIERS_VENV` names another) and the project never imports
it: `verifiers_runner.py` runs there, and this module talks JSON lines to it.

- `load_records` (prepare): the runner lists the first `task.num_train + task.num_eval` tasks; a seeded
  shuffle gives the held-out split (`task.num_eval` of them) and the train split (the rest). Each
  record's `answer` is the task data's `answer` field (a taskset without one is refused, naming it),
  its meta the task's index and key.
- `run_episode` (the run's agent): one long-lived runner process per spec and rollout worker (importing
  verifiers takes seconds) runs the episode with the taskset's harness (`null`, the tool-less chat loop
  that still serves the taskset's MCP toolsets, when it bundles none) in the local subprocess runtime,
  against the in-process proxy at `base_url` with the episode's key, so the tokens trained are the tokens
  served. The reward is the env's rubric (its weighted reward functions' total); each function's own
  score goes to the rows' `reward_info["rewards"]` (the trainer logs `reward/<name>`). An episode the
  env failed (it raised in setup, a tool server, a reward) raises EpisodeFailed: a counted failed
  episode. A non-finite rubric total raises the agent workflow's BadReward, naming the functions: the
  episode is counted apart (`episodes_bad_reward`) and never trained on.

Everything read back from the runner is bounded (a line, the records) and parsed as JSON only.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import subprocess
import threading
from pathlib import Path
from typing import Any

from areal_core.config.base import ConfigError

KEY = "rollout.environment"
RUNNER = Path(__file__).with_name("verifiers_runner.py")
ROOT = Path(__file__).resolve().parents[2]
MAX_RECORDS_BYTES = 256 << 20
MAX_LINE = 16 << 20
RECORDS_TIMEOUT_S = 900.0


def venv_dir() -> Path:
    return Path(os.environ.get("AREAL_VERIFIERS_VENV") or ROOT / ".venv-verifiers")


def venv_python() -> Path:
    py = venv_dir() / "bin" / "python"
    if not py.exists():
        raise ConfigError(
            f"config key '{KEY}': verifiers environments run in the side venv {venv_dir()}, which is missing "
            "(run scripts/setup_verifiers_venv.sh, or set AREAL_VERIFIERS_VENV)"
        )
    return py


def _refused(spec: str, why: str) -> ConfigError:
    return ConfigError(f"config key '{KEY}': verifiers:{spec}: {' '.join(str(why).split())[:1500]}")


def _drain(proc: subprocess.Popen, stream: Any, limit: int, keep_tail: bool, into: list[bytes]) -> None:
    """Read `stream` to its end: the first `limit` bytes (the process is killed past them), or with
    `keep_tail` only its last `limit` bytes (a log)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := stream.read(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if not keep_tail:
                into.append(b"")  # over the limit: no answer
                proc.kill()
                return
            while size - len(chunks[0]) >= limit:
                size -= len(chunks.pop(0))
    into.append(b"".join(chunks)[-limit:] if keep_tail else b"".join(chunks))


def list_tasks(spec: str, limit: int) -> list[dict[str, Any]]:
    """The first `limit` tasks of `spec` as the runner describes them: idx, key, id, prompt, answer."""
    proc = subprocess.Popen(
        [str(venv_python()), str(RUNNER), "records", spec, str(limit)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [
        threading.Thread(target=_drain, args=(proc, proc.stdout, MAX_RECORDS_BYTES, False, out), daemon=True),
        threading.Thread(target=_drain, args=(proc, proc.stderr, 64 << 10, True, err), daemon=True),
    ]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=RECORDS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise _refused(spec, f"listing its tasks took over {RECORDS_TIMEOUT_S:g} s") from None
    for t in readers:
        t.join(timeout=30)
    if out == [b""]:
        raise _refused(spec, f"the runner wrote over {MAX_RECORDS_BYTES} bytes of tasks")
    lines = (out[0] if out else b"").decode("utf-8", "replace").strip().splitlines()
    try:
        msg = json.loads(lines[-1]) if lines else None
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        tail = (err[0] if err else b"").decode("utf-8", "replace").strip().splitlines()[-3:]
        raise _refused(spec, f"the runner failed (exit {proc.returncode}): {' | '.join(tail) or 'no output'}")
    if "fatal" in msg:
        raise _refused(spec, msg["fatal"])
    tasks = msg.get("tasks")
    if not isinstance(tasks, list):
        raise _refused(spec, "the runner's answer has no task list")
    return [_checked_task(spec, t) for t in tasks]


def _checked_task(spec: str, t: Any) -> dict[str, Any]:
    ok = (
        isinstance(t, dict)
        and isinstance(t.get("idx"), int)
        and isinstance(t.get("key"), str)
        and isinstance(t.get("prompt"), str)
    )
    if not ok:
        raise _refused(spec, f"a task the runner described is malformed: {str(t)[:200]}")
    return t


def load_records(spec: str, task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records of the taskset `spec` (module docstring)."""
    tasks = list_tasks(spec, task.num_train + task.num_eval)
    if len(tasks) < 2:
        raise _refused(spec, f"its taskset gave {len(tasks)} task(s): a run needs at least 2 (train and held-out)")
    records = []
    for t in tasks:
        answer = t.get("answer")
        if answer is None or answer == "":
            raise _refused(spec, f"task {t['idx']} has an empty 'answer'")
        meta = {"verifiers": {"idx": t["idx"], "key": t["key"], "id": t.get("id")}}
        records.append({"prompt": t["prompt"], "answer": answer, "prompt_id": f"verifiers-{t['idx']}", "meta": meta})
    random.Random(seed).shuffle(records)
    n_eval = min(task.num_eval, len(records) // 2)
    return records[n_eval:], records[:n_eval]


class EpisodeFailed(RuntimeError):
    """The environment failed the episode (its setup, a tool server, a reward function raised)."""


class RunnerProcess:
    """One `verifiers_runner.py serve SPEC` process: requests by id from any event loop, answers read by
    a thread. A runner that exits fails the requests in flight; the next request starts a new one."""

    def __init__(self, spec: str):
        self.spec = spec
        self.proc = subprocess.Popen(
            [str(venv_python()), str(RUNNER), "serve", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the runner's log goes to the worker's
        )
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.next_id = 0
        self.fatal: str | None = None
        threading.Thread(target=self._read, name=f"verifiers-runner-{self.proc.pid}", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self.fatal is None

    def _read(self) -> None:
        stream = self.proc.stdout
        while line := stream.readline(MAX_LINE + 1):
            if len(line) > MAX_LINE:
                self.fatal = f"the runner wrote a line over {MAX_LINE} bytes"
                self.proc.kill()
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if "fatal" in msg:
                self.fatal = str(msg["fatal"])[:2000]
                break
            rid = msg.get("id")
            with self.lock:
                entry = self.pending.pop(rid, None) if isinstance(rid, int) else None
            if entry is not None:
                _settle(entry, result=msg)
        code = self.proc.wait()
        why = self.fatal or f"the verifiers runner exited (code {code})"
        with self.lock:
            pending, self.pending = self.pending, {}
        for entry in pending.values():
            _settle(entry, error=EpisodeFailed(why))

    def _write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    async def request(self, req: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.lock:
            rid = self.next_id = self.next_id + 1
            self.pending[rid] = (loop, fut)
        try:
            await asyncio.to_thread(self._write, (json.dumps({"id": rid, **req}) + "\n").encode())
        except OSError as exc:  # the runner is gone; its reader fails what is pending
            with self.lock:
                self.pending.pop(rid, None)
            raise EpisodeFailed(self.fatal or f"the verifiers runner is gone ({exc})") from None
        try:
            return await fut
        except asyncio.CancelledError:  # the episode timed out: the runner stops it too
            with contextlib.suppress(OSError):
                self._write((json.dumps({"op": "cancel", "target": rid}) + "\n").encode())
            raise
        finally:
            with self.lock:
                self.pending.pop(rid, None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _settle(entry: tuple[asyncio.AbstractEventLoop, asyncio.Future], result: Any = None, error: Any = None) -> None:
    loop, fut = entry

    def set_it() -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    if not loop.is_closed():
        loop.call_soon_threadsafe(set_it)


_RUNNERS: dict[str, RunnerProcess] = {}
_RUNNERS_LOCK = threading.Lock()


def runner(spec: str) -> RunnerProcess:
    """This process's runner of `spec`, started on first use (again after it exited; a runner whose
    environment failed to load keeps failing with that reason)."""
    with _RUNNERS_LOCK:
        r = _RUNNERS.get(spec)
        if r is None or (r.proc.poll() is not None and r.fatal is None):
            r = _RUNNERS[spec] = RunnerProcess(spec)
        return r


@atexit.register
def close_runners() -> None:
    with _RUNNERS_LOCK:
        for r in _RUNNERS.values():
            r.close()
        _RUNNERS.clear()


def _task_ref(task: dict[str, Any]) -> dict[str, Any]:
    ref = (task.get("meta") or {}).get("verifiers")
    if not isinstance(ref, dict) or not isinstance(ref.get("idx"), int):
        raise ValueError(f"prompt {task.get('prompt_id')!r} names no verifiers task (meta.verifiers.idx)")
    return {"idx": ref["idx"], "key": ref.get("key")}


async def run_episode(spec: str, task: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    """One episode of the task against the proxy: {"reward": the rubric's total, "info": {"rewards": each
    reward function's score, "weights", "metrics"}}; raises EpisodeFailed when the env failed it."""
    r = runner(spec)
    if r.fatal is not None:
        raise EpisodeFailed(r.fatal)
    res = await r.request({"op": "episode", **_task_ref(task), "base_url": base_url, "api_key": api_key})
    return _result(res)


async def score(spec: str, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the env's rubric gives the transcript `messages` of `task` (offline: no runtime)."""
    return _result(await runner(spec).request({"op": "score", **_task_ref(task), "messages": messages}))


def _result(res: dict[str, Any]) -> dict[str, Any]:
    if res.get("error"):
        raise EpisodeFailed(str(res["error"])[:1000])
    reward = res.get("reward")
    info = res.get("info") if isinstance(res.get("info"), dict) else {}
    if res.get("nonfinite"):
        from areal_core.proxy.agent_workflow import BadReward  # the agent workflow counts it apart

        names = ", ".join(map(str, info.get("nonfinite") or [])) or "its reward functions"
        raise BadReward(f"reward must be finite: the rubric's {names[:200]} gave a score that is not")
    if reward is not None and (not isinstance(reward, (int, float)) or isinstance(reward, bool)):
        raise EpisodeFailed(f"the runner answered a reward that is not a number: {str(reward)[:100]}")
    return {"reward": reward, "info": info}
