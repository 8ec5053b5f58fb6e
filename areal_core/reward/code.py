"""Code reward: the completion's Python program, called by the task's unit tests across the sandbox boundary.

Use it by import path: `reward.function: areal_core.reward.code:code_reward`.

The task's tests come from the prompt record's `answer` (what the reward worker passes as
`reference`), a JSON object:

    {"tests": ["assert add(1, 2) == 3", {"stdin": "1 2\\n", "stdout": "3"}, ...],
     "setup": "import math\\n...",        # optional: trusted code run on the host before each code test
     "prefix": "def f(x):\\n    ...",      # optional: code the program starts with (HumanEval's prompt)
     "entry_point": "f",                  # optional, with prefix: the function the completion writes
     "limits": {"wall_s": 5, "memory_mb": 256, ...},   # optional, see sandbox.Limits
     "parallel": 2}                                     # optional, stdin/stdout tests run at once

or, when `reference` is not such JSON, from `meta` (the same keys). The reward is the fraction
of tests passed; `info` has passed/total and the failure reasons. A task that cannot be run
(malformed spec, unknown limits) scores 0 with the reason in `info["error"]`: this function
never raises for a data-set problem. Without bubblewrap it raises `SandboxUnavailable` (the
pool records it as the error); nothing is ever run unsandboxed.

See docs/reward.md ("Bring your own test suite") for what runs where.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from areal_core.reward.grading import run_tests
from areal_core.reward.sandbox import Limits, Sandbox, SandboxUnavailable

__all__ = ["code_reward", "extract_code", "task_spec", "program_of", "SandboxUnavailable", "TaskError"]

DEFAULT_PARALLEL = 2
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
_STOPS = ("\ndef", "\nclass", "\nif", "\nprint", "\n#", "\n```")  # where a continuation's function body ends
_sandboxes: dict[Limits, Sandbox] = {}


class TaskError(ValueError):
    """The task's spec cannot be run (a data-set problem, scored 0 with this reason)."""


def extract_code(completion: str) -> str | None:
    """The last ```python block (an unclosed one runs to the end); else the last ``` block;
    else the completion itself when it looks like Python (has `def`/`import`/`print(`)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    chosen = python or [b for lang, b in blocks if not lang]
    if chosen:
        code = chosen[-1].strip("\n")
        return code if code.strip() else None
    if re.search(r"^\s*(def |import |from \w+ import |print\()", completion, re.M):
        return completion.strip("\n")
    return None


def task_spec(reference: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The validated spec from the JSON reference, else from meta; raises TaskError."""
    spec: Any = None
    if reference and reference.lstrip().startswith("{"):
        try:
            spec = json.loads(reference)
        except json.JSONDecodeError:
            spec = None
    if not isinstance(spec, dict) or "tests" not in spec:
        spec = dict(meta or {})
    tests = spec.get("tests") or []
    if not isinstance(tests, list):
        raise TaskError(f"tests must be a list, not {type(tests).__name__}")
    out: dict[str, Any] = {"tests": tests}
    for key in ("setup", "prefix", "entry_point"):
        value = spec.get(key) or ""
        if not isinstance(value, str):
            raise TaskError(f"{key} must be a string, not {type(value).__name__}")
        out[key] = value
    limits, parallel = spec.get("limits") or {}, spec.get("parallel") or DEFAULT_PARALLEL
    if not isinstance(limits, dict):
        raise TaskError(f"limits must be an object, not {type(limits).__name__}")
    if type(parallel) is not int or parallel < 1:
        raise TaskError(f"parallel must be a positive integer, not {parallel!r}")
    try:
        out["limits"] = Limits.from_dict(limits)
    except (TypeError, ValueError) as exc:
        raise TaskError(str(exc)) from None
    out["parallel"] = parallel
    return out


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def program_of(completion: str, spec: dict[str, Any]) -> str | None:
    """The program to run: the completion's code, after the task's `prefix` when it has one.

    With a prefix (HumanEval's prompt), a completion whose code block restates the entry point
    runs after the prefix (so the prompt's imports and helpers are there); any other completion
    is a continuation of the prefix, cut where the function body ends (HumanEval's stop words).
    """
    code = extract_code(completion)
    prefix = spec.get("prefix") or ""
    if not prefix:
        return code
    entry = spec.get("entry_point") or ""
    if code is not None and (_defines(code, entry) if entry else code != completion.strip("\n")):
        return prefix.rstrip("\n") + "\n\n\n" + code + "\n"
    cut = min([i for i in (completion.find(s) for s in _STOPS) if i >= 0] or [len(completion)])
    return prefix + completion[:cut] + "\n"


def sandbox_for(limits: Limits) -> Sandbox:
    """One Sandbox per distinct limits in this process (built, and probed, once)."""
    if limits not in _sandboxes:
        _sandboxes[limits] = Sandbox(limits)
    return _sandboxes[limits]


def code_reward(completion: str, reference: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fraction of the task's unit tests the completion's program passes."""
    try:
        spec = task_spec(reference, meta)
    except TaskError as exc:
        return {"reward": 0.0, "info": {"error": f"the task cannot be run: {exc}", "passed": 0, "total": 0}}
    if not spec["tests"]:
        return {"reward": 0.0, "info": {"error": "the task has no tests", "passed": 0, "total": 0}}
    program = program_of(completion, spec)
    if program is None:
        return {"reward": 0.0, "info": {"error": "no code found in the completion", "passed": 0, "total": 0}}
    try:
        program.encode()
    except UnicodeEncodeError:  # a lone surrogate: no file can hold the program as UTF-8
        return {"reward": 0.0, "info": {"error": "the program is not valid UTF-8", "passed": 0, "total": 0}}
    sandbox = sandbox_for(spec["limits"])
    report = run_tests(sandbox, program, spec["tests"], parallel=spec["parallel"], setup=spec["setup"])
    info: dict[str, Any] = {"passed": report.passed, "total": report.total}
    if report.passed < report.total:
        info["failures"] = report.reasons()
    return {"reward": report.score, "info": info}
