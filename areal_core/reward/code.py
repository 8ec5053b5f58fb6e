"""Code reward: the completion's Python code run against the task's unit tests in the sandbox.

Use it by import path: `reward.function: areal_core.reward.code:code_reward`.

The task's tests come from the prompt record's `answer` (what the reward worker passes as
`reference`), a JSON object:

    {"tests": ["assert add(1, 2) == 3", {"stdin": "1 2\\n", "stdout": "3"}, ...],
     "limits": {"wall_s": 5, "memory_mb": 256, ...},   # optional, see sandbox.Limits
     "parallel": 2}                                     # optional, tests run at once

or, when `reference` is not such JSON, from `meta["tests"]` (and `meta["limits"]`).
The reward is the fraction of tests passed; `info` has passed/total and the failure reasons.
Without bubblewrap the call raises `SandboxUnavailable` (the pool records it as the error);
nothing is ever run unsandboxed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areal_core.reward.sandbox import Limits, Sandbox, SandboxUnavailable

__all__ = ["code_reward", "extract_code", "task_spec", "SandboxUnavailable"]

DEFAULT_PARALLEL = 2
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
_sandboxes: dict[Limits, Sandbox] = {}


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
    """{"tests", "limits", "parallel"} from the JSON reference, else from meta."""
    spec: Any = None
    if reference and reference.lstrip().startswith("{"):
        try:
            spec = json.loads(reference)
        except json.JSONDecodeError:
            spec = None
    if not isinstance(spec, dict) or "tests" not in spec:
        spec = dict(meta or {})
    return {
        "tests": list(spec.get("tests") or []),
        "limits": dict(spec.get("limits") or {}),
        "parallel": int(spec.get("parallel") or DEFAULT_PARALLEL),
    }


def sandbox_for(limits: Limits) -> Sandbox:
    """One Sandbox per distinct limits in this process (built, and probed, once)."""
    if limits not in _sandboxes:
        _sandboxes[limits] = Sandbox(limits)
    return _sandboxes[limits]


def code_reward(completion: str, reference: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fraction of the task's unit tests the completion's code passes, run in the sandbox."""
    spec = task_spec(reference, meta)
    if not spec["tests"]:
        return {"reward": 0.0, "info": {"error": "the task has no tests", "passed": 0, "total": 0}}
    code = extract_code(completion)
    if code is None:
        return {"reward": 0.0, "info": {"error": "no code found in the completion", "passed": 0, "total": 0}}
    sandbox = sandbox_for(Limits.from_dict(spec["limits"]))
    report = sandbox.run_tests(code, spec["tests"], parallel=spec["parallel"])
    info: dict[str, Any] = {"passed": report.passed, "total": report.total}
    if report.passed < report.total:
        info["failures"] = report.reasons()
    return {"reward": report.score, "info": info}
