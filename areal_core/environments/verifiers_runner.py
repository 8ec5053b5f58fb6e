"""The verifiers side of `rollout.environment=verifiers:<spec>`: run as a script by the side venv's
python (`.venv-verifiers/bin/python`, scripts/setup_verifiers_venv.sh). The project never imports
this file or verifiers; `verifiers_env.py` starts it and talks JSON lines to it.

    verifiers_runner.py warm                  install and lock the harness chat program (setup script)
    verifiers_runner.py records SPEC LIMIT    one JSON line: the first LIMIT tasks (or an error), then exit
    verifiers_runner.py serve SPEC            episodes on request, JSON lines on stdin and stdout

SPEC is `<taskset id or import path>[?key=value&...]`: a taskset id as verifiers resolves it
(`vf-arith`, `owner/name@version`) or an import path (`pkg.module`, `pkg.module:TasksetClass`), and
options: `harness` (the harness id for every agent seat; default: the taskset's own, else `null`),
`max_turns`, and any other key as a field of the taskset's config (`num_tasks=200`). Values are read
as JSON when they parse, else as strings. Every agent runs in the local subprocess runtime.

serve: the first line out is `{"ready": true}` (or `{"fatal": "..."}`); then one answer per request,
by its `id`. Requests: `{"id", "op": "episode", "idx", "key", "base_url", "api_key"}` runs one episode
of task `idx` against the OpenAI-compatible endpoint `base_url` with `api_key`, and answers
`{"id", "reward", "nonfinite", "info": {"rewards", "weights", "metrics"}, "error"}`; `{"id", "op":
"score", "idx", "messages"}` scores a transcript (OpenAI chat messages) offline with the task's rubric
(no runtime: runtime-bound signals are skipped); `{"id", "op": "stats"}` says what the runner holds;
`{"op": "cancel", "target": id}` cancels a request (no answer). stdout carries only these lines: whatever else writes
to fd 1 (a library, a child process) goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import threading
import types
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

VENV = Path(sys.prefix)
MAX_LINE = 16 << 20
OPTIONS = ("harness", "max_turns")


class SpecError(ValueError):
    """The spec names nothing loadable, or the taskset cannot be used; the message says why."""


def hermetic() -> None:
    """The harness programs and their uv environments live in this venv (warmed by the setup script)."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    SubprocessRuntime.scripts_dir = str(VENV / "vf-scripts")
    os.environ.setdefault("UV_CACHE_DIR", str(VENV / "uv-cache"))
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    os.environ.setdefault("UV_PYTHON", sys.executable)
    os.environ["PATH"] = f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


def parse_spec(spec: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(taskset id, options, taskset config fields)."""
    ident, _, query = spec.partition("?")
    options: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        (options if key in OPTIONS else fields)[key] = value
    return taskset_id(ident.strip()), options, fields


def taskset_id(ident: str) -> str:
    """A verifiers taskset id as it is; an import path (`pkg.module`, `pkg.module:Name`) as the id of
    an alias module exporting that module's (or that one) Taskset, which verifiers' loader resolves."""
    if not ident:
        raise SpecError("names no taskset")
    if "/" in ident or "@" in ident or not ("." in ident or ":" in ident):
        return ident
    import importlib

    from verifiers.v1 import Taskset

    module_name, _, attr = ident.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    names = [attr] if attr else list(getattr(module, "__all__", None) or vars(module))
    found = [obj for n in names if isinstance(obj := getattr(module, n, None), type) and issubclass(obj, Taskset)]
    found = [c for c in dict.fromkeys(found) if c is not Taskset]
    if len(found) != 1:
        what = f"{attr!r} is not a Taskset class" if attr else f"exports {len(found)} Taskset classes, not one"
        raise SpecError(f"{ident}: {what}")
    alias = "areal_vf_" + uuid.uuid5(uuid.NAMESPACE_URL, ident).hex[:12]
    mod = types.ModuleType(alias)
    mod.__all__ = [found[0].__name__]
    setattr(mod, found[0].__name__, found[0])
    sys.modules[alias] = mod
    return alias


def build_env(spec: str) -> Any:
    """The verifiers Env of `spec`, every agent seat in the local subprocess runtime."""
    import verifiers.v1 as vf

    tid, options, fields = parse_spec(spec)
    try:
        cls = vf.env_config_type(tid)
    except (ImportError, TypeError, AttributeError, ValueError) as exc:
        raise SpecError(f"{type(exc).__name__}: {exc}") from None
    # verifiers' default harness, bash, hands the policy a shell on the rollout machine: a seat that pins
    # none gets `null` instead (the taskset's own harness, or harness=..., when there is one)
    fallback = "null" if vf.default_harness_id(tid) == "bash" else None
    raw: dict[str, Any] = {"taskset": {"id": tid, **fields}, "interception": {"type": "server"}}
    for name, field in cls.model_fields.items():
        if not isinstance(field.default, vf.AgentConfig):
            continue
        seat: dict[str, Any] = {"runtime": {"type": "subprocess"}}
        harness = options.get("harness") or (fallback if field.default.harness is None else None)
        if harness is not None:
            seat["harness"] = {"id": str(harness)}
        if options.get("max_turns") is not None:
            seat["max_turns"] = options["max_turns"]
        raw[name] = seat
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the taskset's own code failed: one line back to prepare
        raise SpecError(f"loading the environment failed: {type(exc).__name__}: {exc}") from None


def task_record(task: Any) -> dict[str, Any]:
    data = task.data
    dumped = data.model_dump(mode="json")
    if "answer" not in dumped:
        from verifiers.v1 import TaskData

        own = ", ".join(sorted(set(dumped) - set(TaskData.model_fields))) or "none"
        raise SpecError(
            f"its tasks have no 'answer' field ({type(data).__name__}'s own fields: {own}): add the reference "
            "answer to the task data (answer: str), which the run keeps as each prompt's reference"
        )
    prompt = data.prompt_text or data.description or data.name or data.id or f"verifiers task {data.idx}"
    return {"idx": data.idx, "key": task.key, "id": data.id, "prompt": prompt, "answer": dumped["answer"]}


class Tasks:
    """The taskset's tasks by index, read from one iteration as far as asked."""

    def __init__(self, taskset: Any):
        self.it, self.by_idx = iter(taskset), {}

    def get(self, idx: int) -> Any:
        while idx not in self.by_idx:
            task = next(self.it, None)
            if task is None:
                raise KeyError(f"the taskset has no task {idx}")
            self.by_idx[task.data.idx] = task
        return self.by_idx[idx]


def finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def summary(traces: list[Any]) -> tuple[float | None, bool, dict[str, Any]]:
    """(reward, non-finite, info) of an episode's trainable traces: the mean of their weighted
    rubric totals, and each reward function's own score and weight, each metric (means)."""
    traces = [t for t in traces if t.agent.trainable] or traces
    scores: dict[str, list[float]] = {}
    weights: dict[str, float] = {}
    metrics: dict[str, list[float]] = {}
    nonfinite: list[str] = []
    for t in traces:
        for name, r in t.rewards.items():
            if r is None:
                continue
            scores.setdefault(name, []).append(float(r.score))
            weights[name] = float(r.weight)
        for name, v in t.metrics.items():
            if v is not None:
                metrics.setdefault(name, []).append(float(v))
    mean = {n: sum(v) / len(v) for n, v in scores.items()}
    for n, v in mean.items():
        if not math.isfinite(v):
            nonfinite.append(n)
    info = {
        "rewards": {n: finite(v) for n, v in mean.items()},
        "weights": weights,
        "metrics": {n: finite(sum(v) / len(v)) for n, v in metrics.items()},
    }
    if nonfinite:
        info["nonfinite"] = nonfinite
    totals = [t.reward for t in traces]
    reward = sum(totals) / len(totals) if totals else None
    return finite(reward), reward is not None and not math.isfinite(reward), info


def error_of(episode: Any) -> str | None:
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if episode.ok and not errors:
        return None
    if not errors:
        return "the episode did not complete"
    e = errors[-1]
    return f"{e.type}: {e.message}"[:1000]


class Runner:
    def __init__(self, spec: str, out: Any):
        self.env = build_env(spec)
        self.tasks = Tasks(self.env.taskset)
        self.out, self.lock = out, threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, allow_nan=False, default=str) + "\n"
        with self.lock:
            self.out.write(line)
            self.out.flush()

    def task(self, req: dict[str, Any]) -> Any:
        task = self.tasks.get(int(req["idx"]))
        if req.get("key") and task.key != req["key"]:
            raise SpecError(f"task {req['idx']} is not the one prepare recorded (the taskset's load() changed)")
        return task

    async def episode(self, req: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        task = self.task(req)
        var = f"AREAL_VF_API_KEY_{uuid.uuid4().hex}"  # "API_KEY": verifiers keeps it from the processes it starts
        os.environ[var] = str(req["api_key"])
        client = vf.EvalClientConfig(base_url=str(req["base_url"]), api_key_var=var)
        try:
            episode = await self.env.run_episode(task, vf.ModelContext(model="policy", client=client))
        finally:
            os.environ.pop(var, None)
            await self.forget(client)
        reward, nonfinite, info = summary(episode.traces)
        return {"reward": reward, "nonfinite": nonfinite, "info": info, "error": error_of(episode)}

    async def forget(self, client: Any) -> None:
        """Close the interception server's client of this episode's key (it keeps one per distinct config)."""
        server = getattr(self.env, "_interception", None)
        clients = getattr(server, "clients", None)
        if isinstance(clients, dict) and (c := clients.pop(client.model_dump_json(), None)) is not None:
            await c.close()

    async def score(self, req: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf
        from verifiers.v1.dialects.chat import parse_message

        task = self.task(req)
        nodes = []
        for i, m in enumerate(req["messages"]):  # OpenAI chat messages, as verifiers' chat dialect reads them
            sampled = m.get("role") == "assistant"
            nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=parse_message(m), sampled=sampled))
        data = task.data
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
        )
        await task.score(trace)
        reward, nonfinite, info = summary([trace])
        return {"reward": reward, "nonfinite": nonfinite, "info": info, "error": None}

    async def stats(self, req: dict[str, Any]) -> dict[str, Any]:
        """What the runner holds: the interception server's model clients (one per episode in flight)
        and the tasks read so far."""
        clients = getattr(getattr(self.env, "_interception", None), "clients", None)
        return {
            "info": {"clients": len(clients) if isinstance(clients, dict) else None, "tasks": len(self.tasks.by_idx)}
        }

    async def answer(self, req: dict[str, Any]) -> None:
        try:
            op = {"episode": self.episode, "score": self.score, "stats": self.stats}[req["op"]]
            res = await op(req)
        except Exception as exc:  # noqa: BLE001 - one failed request, the runner goes on
            res = {"reward": None, "info": {}, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        self.send({"id": req.get("id"), **res})

    async def serve(self, lines: asyncio.Queue) -> None:
        pending: dict[Any, asyncio.Task] = {}
        async with self.env.serving():
            self.send({"ready": True})
            while (line := await lines.get()) is not None:
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                except ValueError as exc:
                    self.send({"id": None, "error": f"bad request: {exc}"})
                    continue
                if req.get("op") == "cancel":  # the worker gave up on it (its episode timed out)
                    if (t := pending.get(req.get("target"))) is not None:
                        t.cancel()
                    continue
                rid = req.get("id")
                t = pending[rid] = asyncio.create_task(self.answer(req))
                t.add_done_callback(lambda _, rid=rid: pending.pop(rid, None))
            for t in list(pending.values()):
                t.cancel()


def read_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, stream: Any) -> None:
    """stdin's lines into `queue` (a line over MAX_LINE is refused); None at EOF: the parent is gone."""
    while line := stream.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE:
            while line and not line.endswith(b"\n"):
                line = stream.readline(MAX_LINE + 1)
            line = b"{}"
        loop.call_soon_threadsafe(queue.put_nowait, line.decode("utf-8", "replace"))
    loop.call_soon_threadsafe(queue.put_nowait, None)


def protocol_stdout() -> Any:
    """A private copy of fd 1 for the protocol; fd 1 itself (and sys.stdout) then go to stderr."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


async def serve(spec: str, out: Any) -> None:
    try:
        runner = Runner(spec, out)
    except Exception as exc:  # noqa: BLE001 - told to the parent as one line
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"[:2000]}) + "\n")
        out.flush()
        return
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    threading.Thread(target=read_lines, args=(loop, queue, sys.stdin.buffer), daemon=True).start()
    await runner.serve(queue)


def records(spec: str, limit: int, out: Any) -> None:
    try:
        env = build_env(spec)
        taskset = env.taskset if env.taskset.bounded and limit <= 0 else env.taskset.take(limit)
        try:
            tasks = list(taskset)
        except Exception as exc:  # noqa: BLE001 - the taskset's own code
            raise SpecError(f"its taskset's load() failed: {type(exc).__name__}: {exc}") from None
        msg: dict[str, Any] = {"tasks": [task_record(t) for t in tasks]}
    except Exception as exc:  # noqa: BLE001 - told to the parent as one line
        msg = {"fatal": f"{type(exc).__name__}: {exc}"[:2000] if not isinstance(exc, SpecError) else str(exc)}
    out.write(json.dumps(msg, default=str) + "\n")
    out.flush()


def warm() -> None:
    """Install the harness chat program's uv environment and lock it, so runs need no index."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    async def prepare() -> list[str]:
        runtime = SubprocessRuntime(SubprocessConfig())
        await runtime.start()
        try:
            return await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, {}, activate=False)
        finally:
            await runtime.teardown()

    argv = asyncio.run(prepare())
    script = argv[-1]
    subprocess.run([str(VENV / "bin" / "uv"), "lock", "--script", script, "-q", "--no-config"], check=True)
    print(f"harness chat program ready: {script} (+ .lock), python {argv[0]}")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="verifiers-runner %(levelname)s %(message)s")
    hermetic()
    cmd = argv[0] if argv else ""
    if cmd == "warm":
        return warm()
    out = protocol_stdout()
    if cmd == "records" and len(argv) == 3:
        return records(argv[1], int(argv[2]), out)
    if cmd == "serve" and len(argv) == 2:
        return asyncio.run(serve(argv[1], out))
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
