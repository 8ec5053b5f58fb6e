"""The trusted test process: runs a task's test code on the host against the sandboxed program.

    python -I -S -B harness.py REQUEST_FD RESPONSE_FD RESULTS_FD  < job.json

Started by `areal_core.reward.boundary`, once per sandbox session; stdlib only. The job holds
the tests (Python source: asserts, loops, helpers, HumanEval's `check(candidate)`, verbatim),
the task's trusted `setup` code and the limits. For each test it forks a child of its own with
its own limits (address space, CPU seconds, wall clock); the child compiles the test, asks the
sandbox for the names the test uses but does not define (`remote.Session.begin`), binds them
(`remote.bind`), runs the setup and the test with the host's own builtins, and reports one
record: `{"i", "ok", "reason", "lost", "ended", "loaded"}`. The test passes when its code ran
to the end and no call failed. Records go to RESULTS_FD as JSON lines; after a record whose
channel is `lost` the session ends and the host starts a fresh sandbox for the rest.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import os
import resource
import select
import sys
import time
import traceback
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str, alias: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(alias, os.path.join(HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def needed_names(trees: list[ast.Module]) -> set[str]:
    """Names the code reads but neither binds at module level nor gets from builtins."""
    loads: set[str] = set()
    bound: set[str] = set()

    def scope(node: ast.AST) -> None:  # module-level bindings: stop at function, class and lambda bodies
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in child.names)
            elif isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
                bound.add(child.id)
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                scope(child)

    for tree in trees:
        scope(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                loads.add(node.id)
            elif isinstance(node, ast.Global):
                bound.update(node.names)
    return {n for n in loads - bound - set(dir(builtins)) if not n.startswith("__")}


def describe(exc: BaseException) -> str:
    text = str(exc)
    return (type(exc).__name__ + (": " + text if text else ""))[:300]


def assertion_reason(exc: BaseException, tree: ast.Module, session: Any) -> str:
    """`assertion failed: <the assert's condition> (got <the last value the program returned>)`."""
    lines = [tb.lineno for tb in traceback.extract_tb(exc.__traceback__) if tb.filename == "test.py"]
    src = ""
    if lines:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and node.lineno <= lines[-1] <= (node.end_lineno or node.lineno):
                src = ast.unparse(node.test)
    got = f" (got {session.last[1]!r:.80})" if session.last is not None else ""
    return f"assertion failed: {src[:120] or describe(exc)}{got}"


def run_test(
    remote: ModuleType, chan: Any, setup: str, test: str, limits: dict[str, Any], first: bool
) -> dict[str, Any]:
    """Run one test in this (child) process; its record."""
    session = remote.Session(chan, limits["call_s"])
    record: dict[str, Any] = {"ok": False, "reason": "", "lost": None, "ended": None, "loaded": False}
    try:
        trees = [ast.parse(setup or "", "setup.py"), ast.parse(test, "test.py")]
        codes = [compile(trees[0], "setup.py", "exec"), compile(trees[1], "test.py", "exec")]
    except (SyntaxError, ValueError) as exc:
        record["reason"] = f"the test does not compile: {describe(exc)}"
        return record
    ns = {"__name__": "__test__", "__builtins__": builtins}
    try:
        wanted = needed_names(trees)
        remote.bind(session, session.begin(wanted, limits["wall_s"] if first else limits["call_s"]), wanted, ns)
        for code in codes:
            exec(code, ns)
        record["ok"] = True
    except remote.BoundaryFailure:
        pass
    except AssertionError as exc:
        record["reason"] = assertion_reason(exc, trees[1], session)
    except remote.RemoteError as exc:
        text = str(exc)[:200]
        record["reason"] = f"the program raised {exc.remote_name}" + (f": {text}" if text else "")
    except BaseException as exc:
        record["reason"] = f"test raised {describe(exc)}"
    session.end()
    if session.failure is not None:
        record.update(ok=False, reason=session.failure)
    record.update(lost=session.lost, ended=session.ended, loaded=session.loaded)
    return record


def in_child(remote: ModuleType, chan: Any, job: dict[str, Any], i: int, first: bool) -> dict[str, Any]:
    """Fork a child with its own limits for test `i`; its record (the child is killed at the deadline)."""
    limits = job["limits"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        mem = limits["memory_mb"] * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
        try:
            record = run_test(remote, chan, job["setup"], job["tests"][i], limits, first)
        except BaseException as exc:  # the harness itself failed (memory, ...): this test cannot pass
            record = {"ok": False, "reason": f"the test process failed: {describe(exc)}", "lost": "protocol"}
        os.write(w, json.dumps(record).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + limits["wall_s"] * (2 if first else 1) + 1
    data, timed_out = b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            timed_out = True
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    if timed_out:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {
            "ok": False,
            "reason": f"timeout: wall clock over {limits['wall_s']:g}s (sandbox killed)",
            "lost": "timeout",
        }
    try:
        return json.loads(data)
    except ValueError:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        reason = "test cpu time limit (SIGXCPU)" if how == "signal 24" else f"the test process died ({how})"
        return {"ok": False, "reason": reason, "lost": "protocol"}


def main() -> None:
    req_w, resp_r, results_fd = (int(a) for a in sys.argv[1:4])
    job = json.load(sys.stdin)
    _sibling("codec", "_areal_codec")
    remote = _sibling("remote", "_areal_remote")
    chan = remote.Channel(req_w, resp_r, job["limits"]["output_bytes"])
    for i in range(len(job["tests"])):
        record = in_child(remote, chan, job, i, first=i == 0)
        record["i"] = i
        os.write(results_fd, (json.dumps(record) + "\n").encode())
        if record.get("lost"):
            break
    os._exit(0)


if __name__ == "__main__":
    main()
