"""Code tests across a call boundary: the program in the sandbox, the tests on the host.

`run_code_tests(sandbox, program, tests, setup)` starts one sandbox session for the program
(`Sandbox.spawn("serve")`: the program is loaded once; each test gets a fresh forked worker)
and, beside it, the trusted test process (`harness.py`, `python -I -S`, limits of its own),
connected to the sandbox by two pipes. The test code never enters the sandbox and the
program's objects never leave it: only plain data crosses, in `codec`'s typed encoding.

When a test loses the session (a call ran past its time, the program died or spoke nonsense)
both processes go and a fresh session runs the remaining tests. When the program cannot even
load (it raises, exits, hangs or hits a limit at import), every test fails with that reason.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from areal_core.reward.sandbox import Limits, Sandbox, Spawned, TestOutcome, explain, parse_status

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.py"
CODEC = (HERE / "codec.py").read_text()
SLACK_S = 2.0  # the harness enforces every deadline; this is the backstop past them


def run_code_tests(
    sandbox: Sandbox, program: str, tests: list[str], setup: str = "", limits: Limits | None = None
) -> list[TestOutcome]:
    """One outcome per test, in order."""
    limits = limits or sandbox.limits
    if not limits.call_s:
        limits = replace(limits, call_s=limits.wall_s)
    outcomes: list[TestOutcome] = []
    while len(outcomes) < len(tests):
        got, load_failure = _session(sandbox, program, tests[len(outcomes) :], setup, limits)
        outcomes += got
        if load_failure is not None:
            outcomes += [load_failure] * (len(tests) - len(outcomes))
    return outcomes


def _session(
    sandbox: Sandbox, program: str, tests: list[str], setup: str, limits: Limits
) -> tuple[list[TestOutcome], TestOutcome | None]:
    """Run `tests` until one loses the session; (outcomes, the load failure if the program never loaded)."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    res_r, res_w = os.pipe()
    run: Spawned | None = None
    harness: subprocess.Popen | None = None
    try:
        run = sandbox.spawn("serve", {"solution.py": program, "_codec.py": CODEC}, limits, channel=(req_r, resp_w))
        harness = _start_harness(run.work, tests, setup, limits, (req_w, resp_r, res_w))
        for fd in (req_r, resp_w, req_w, resp_r, res_w):
            os.close(fd)
        req_r = resp_w = req_w = resp_r = res_w = -1
        return _collect(run, harness, res_r, len(tests), limits)
    finally:
        for fd in (req_r, resp_w, req_w, resp_r, res_w, res_r):
            if fd >= 0:
                os.close(fd)
        if harness is not None and harness.poll() is None:
            harness.kill()
            harness.wait()
        if run is not None:
            run.close()


def _start_harness(work: Path, tests: list[str], setup: str, limits: Limits, fds: tuple[int, ...]) -> subprocess.Popen:
    job = {
        "tests": tests,
        "setup": setup,
        "limits": {
            "wall_s": limits.wall_s,
            "call_s": limits.call_s,
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "output_bytes": limits.output_bytes,
        },
    }
    (work / "job.json").write_text(json.dumps(job))
    with open(work / "job.json", "rb") as fin, open(work / "harness.err", "wb") as ferr:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(HARNESS), *map(str, fds)],
            stdin=fin,
            stdout=subprocess.DEVNULL,
            stderr=ferr,
            pass_fds=fds,
            close_fds=True,
            env={"PATH": "/usr/bin:/bin"},
            cwd=work,
        )


def _collect(
    run: Spawned, harness: subprocess.Popen, res_r: int, n: int, limits: Limits
) -> tuple[list[TestOutcome], TestOutcome | None]:
    outcomes: list[TestOutcome] = []
    buffer = b""
    with os.fdopen(os.dup(res_r), "rb", buffering=0) as results:
        os.set_blocking(results.fileno(), False)
        while len(outcomes) < n:
            first = not outcomes
            t0 = time.monotonic()
            deadline = t0 + limits.wall_s * (2 if first else 1) + 1 + SLACK_S
            line, buffer = _next_line(results, buffer, deadline)
            record = _record(line)
            if record is None:  # the harness died or hung: this test cannot be judged
                timeout = f"timeout: wall clock over {limits.wall_s:g}s (sandbox killed)"
                reason = timeout if line is None else _harness_error(run.work)
                outcomes.append(TestOutcome(False, reason, time.monotonic() - t0))
                return outcomes, None
            outcome = TestOutcome(bool(record.get("ok")), _reason(run, record, limits), time.monotonic() - t0)
            if outcome.ok:
                outcome.reason = ""
            if record.get("lost") and first and record.get("loaded") is False:
                return outcomes, outcome  # the program never loaded: the same for every test
            outcomes.append(outcome)
            if record.get("lost"):
                break
    return outcomes, None


def _next_line(results: Any, buffer: bytes, deadline: float) -> tuple[bytes | None, bytes]:
    """The next JSON line from the harness (b"" on EOF, None past the deadline)."""
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([results], [], [], left)[0]:
            return None, buffer
        chunk = results.read(65536)
        if not chunk:
            return b"", buffer
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    return line, rest


def _record(line: bytes | None) -> dict[str, Any] | None:
    if not line:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _reason(run: Spawned, record: dict[str, Any], limits: Limits) -> str:
    """The record's reason, with the sandbox's own account where the program died."""
    reason = str(record.get("reason") or "")
    if record.get("ended"):  # the test's worker died; the zygote said how
        rc = parse_status((str(record["ended"]) + "\n").encode())
        return _died(rc, run.stderr_tail(), limits, reason)
    if record.get("lost") == "ended":  # the whole sandbox went: ask it how
        if not run.wait(SLACK_S):
            run.kill()
        res = run.result()
        return _died(res.returncode, res.stderr, limits, reason, res.reason)
    return reason


def _died(rc: int | None, stderr: str, limits: Limits, during: str, told: str = "") -> str:
    if rc == 0:
        return f"the program left early (exit code 0): {during}" if during else "the program left early (exit code 0)"
    return told or explain(rc, stderr, False, limits) or during


def _harness_error(work: Path) -> str:
    try:
        lines = (work / "harness.err").read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return f"the test process failed: {lines[-1][:200]}" if lines else "the test process failed"
