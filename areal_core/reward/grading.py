"""Scoring a program against a task's unit tests: `run_tests(sandbox, program, tests)`.

Two kinds of test, each judged outside the sandbox:

* a stdin/stdout pair (`{"stdin": "1 2\\n", "stdout": "3"}`): the program runs as `__main__`
  in a sandbox of its own with the stdin; its whole stdout (up to `Limits.output_bytes`) is
  compared here with the expected text (trailing spaces and blank lines ignored). More output
  than the limit is the failure "output over limit", never a truncated comparison. It must
  exit 0. These run `parallel` at a time.
* test code (a string, or `{"code": ...}`): any Python (asserts, loops, helpers, HumanEval's
  `check(candidate)`), run on the host by `boundary.run_code_tests`; the program is only
  called, through the typed boundary. These run one after another in one sandbox session.

A test that cannot be run (an unknown form, code that does not compile) fails with its reason;
nothing here raises for a data-set problem.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from areal_core.reward.boundary import run_code_tests
from areal_core.reward.sandbox import Limits, Sandbox, TestOutcome, TestReport

__all__ = ["run_tests", "test_kind"]


def test_kind(test: Any) -> str:
    """ "code", "io", or "bad"."""
    if isinstance(test, str) or (isinstance(test, dict) and isinstance(test.get("code"), str)):
        return "code"
    if isinstance(test, dict) and ("stdin" in test or "stdout" in test):
        ok = all(isinstance(test.get(k, ""), str) for k in ("stdin", "stdout"))
        return "io" if ok else "bad"
    return "bad"


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def run_io_test(sandbox: Sandbox, program: str, test: dict[str, str], limits: Limits | None = None) -> TestOutcome:
    res = sandbox.run(program, stdin=test.get("stdin", ""), limits=limits)
    if not res.ok:
        return TestOutcome(False, res.reason, res.wall_s)
    if _norm(res.stdout) == _norm(test.get("stdout", "")):
        return TestOutcome(True, "", res.wall_s)
    return TestOutcome(False, f"wrong output: {_norm(res.stdout)[:80]!r}", res.wall_s)


def run_tests(
    sandbox: Sandbox,
    program: str,
    tests: list[Any],
    parallel: int = 2,
    limits: Limits | None = None,
    setup: str = "",
) -> TestReport:
    """Every test's outcome, in the tests' order."""
    outcomes: list[TestOutcome | None] = [None] * len(tests)
    kinds = [test_kind(t) for t in tests]
    code = [i for i, k in enumerate(kinds) if k == "code"]
    io = [i for i, k in enumerate(kinds) if k == "io"]
    for i, k in enumerate(kinds):
        if k == "bad":
            what = sorted(tests[i]) if isinstance(tests[i], dict) else type(tests[i]).__name__
            outcomes[i] = TestOutcome(
                False, f"a test is code or a {{'stdin', 'stdout'}} pair of strings, not {what}", 0
            )
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(io) + bool(code)))) as pool:
        sources = [t if isinstance(t, str) else t["code"] for t in (tests[i] for i in code)]
        session = pool.submit(run_code_tests, sandbox, program, sources, setup, limits) if code else None
        for i, outcome in zip(io, pool.map(lambda i: run_io_test(sandbox, program, tests[i], limits), io)):
            outcomes[i] = outcome
        for i, outcome in zip(code, session.result() if session else []):
            outcomes[i] = outcome
    return TestReport([o for o in outcomes if o is not None])
