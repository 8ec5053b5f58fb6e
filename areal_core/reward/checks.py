"""Assert tests split in two: what runs in the sandbox, and the verdict, computed outside it.

An assert test (`"assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']"`) is parsed here, on
the host. Each top-level assert's condition is a tree of `and`, `or`, `not` and comparisons
whose leaves are either

* constant expressions of literals (`['1', '2']`, `-3`, `True`, `None`): the expected values.
  They stay here and never enter the sandbox;
* anything else (`fizzbuzz(5)`, `len(fizzbuzz(100))`, a comprehension): an expression of the
  program, sent into the sandbox as an `eval` step.

Statements that are not asserts (`x = f(3)`) go in as `exec` steps, in order, so the leaves see
the state the test built. Inside, each leaf's value comes back as JSON with its exact type
(`sandbox_runner.encode`); `verdict` decodes the values into plain Python values and
evaluates the trees here, with Python's own semantics (`and`/`or` short-circuit, chained
comparisons). A program can therefore only make a test pass by reporting the right values:
it never sees the expected ones, and no token, exit code or exception of its own is read as
a pass.

An assert nested in a block (`for ...: assert ...`) would be judged inside the sandbox, so it
is refused: write each expected value in a top-level assert.
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Plan", "plan_test", "decode", "verdict"]

_OPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_CONSTANT_NODES = (
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.UnaryOp,
    ast.BinOp,
    ast.Subscript,
    ast.Slice,
    ast.Load,
    ast.operator,
    ast.unaryop,
)
MAX_DEPTH = 100


@dataclass
class Check:
    src: str  # the assert's condition, as written (host only: it holds the expected values)
    tree: tuple  # ("lit", v) | ("leaf", id) | ("and"|"or", [nodes]) | ("not", node) | ("cmp", [nodes], [ops])


@dataclass
class Plan:
    steps: list[dict[str, Any]] = field(default_factory=list)  # what the sandbox runs: no expected values
    checks: list[Check] = field(default_factory=list)
    leaf_src: dict[int, str] = field(default_factory=dict)


def _is_constant(node: ast.AST) -> bool:
    """Only literals and operators on them: no names, calls or attributes."""
    return all(isinstance(n, _CONSTANT_NODES) for n in ast.walk(node))


def _split(node: ast.expr, plan: Plan) -> tuple:
    if isinstance(node, ast.BoolOp):
        kind = "and" if isinstance(node.op, ast.And) else "or"
        return (kind, [_split(v, plan) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _split(node.operand, plan))
    if isinstance(node, ast.Compare):
        operands = [_split(n, plan) for n in [node.left, *node.comparators]]
        return ("cmp", operands, [type(op) for op in node.ops])
    if _is_constant(node):
        value = eval(compile(ast.Expression(node), "test.py", "eval"), {"__builtins__": {}}, {})
        return ("lit", value)
    leaf = len(plan.leaf_src)
    plan.leaf_src[leaf] = ast.unparse(node)
    plan.steps.append({"kind": "eval", "id": leaf, "src": plan.leaf_src[leaf]})
    return ("leaf", leaf)


def plan_test(code: str) -> Plan:
    """Split one assert test into the sandbox's steps and the checks kept outside."""
    plan = Plan()
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Assert):
            plan.checks.append(Check(ast.unparse(stmt.test), _split(stmt.test, plan)))
            continue
        if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            raise ValueError("an assert inside a block would be judged in the sandbox; make it a top-level assert")
        plan.steps.append({"kind": "exec", "src": ast.unparse(stmt)})
    if not plan.checks:
        raise ValueError("an assert test needs at least one top-level assert")
    return plan


def decode(obj: Any, depth: int = 0) -> Any:
    """Typed JSON from the sandbox -> a plain value (the inverse of `sandbox_runner.encode`)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(obj)
    if obj is None or kind in (bool, int, str):
        return obj
    if kind is list:
        return [decode(v, depth + 1) for v in obj]
    if kind is not dict or len(obj) != 1:
        raise ValueError(f"malformed value {str(obj)[:60]!r}")
    tag, body = next(iter(obj.items()))
    if tag == "float" and type(body) is str:
        return float(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"malformed value {str(obj)[:60]!r}")
    if tag == "dict":
        pairs = [p for p in body if type(p) is list and len(p) == 2]
        if len(pairs) != len(body):
            raise ValueError("malformed dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
    makers = {"tuple": tuple, "set": set, "frozenset": frozenset}
    if tag not in makers:
        raise ValueError(f"unknown value type {tag!r}")
    return makers[tag](decode(v, depth + 1) for v in body)


class _Failed(Exception):
    """A leaf that has no value: the test raised, or never got there."""


def _evaluate(node: tuple, values: dict[int, tuple[bool, Any]]) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "leaf":
        if node[1] not in values:
            raise _Failed("the test harness did not finish (the program left early)")
        ok, payload = values[node[1]]
        if not ok:
            raise _Failed(payload)
        return payload
    if kind == "not":
        return not _evaluate(node[1], values)
    if kind in ("and", "or"):
        result = None
        for child in node[1]:
            result = _evaluate(child, values)
            if bool(result) is (kind == "or"):
                return result
        return result
    operands, ops = node[1], node[2]
    left = _evaluate(operands[0], values)
    for op, right_node in zip(ops, operands[1:]):
        right = _evaluate(right_node, values)
        if not _OPS[op](left, right):
            return False
        left = right
    return True


def _first_leaf(node: tuple) -> int | None:
    if node[0] == "leaf":
        return node[1]
    children = [node[1]] if node[0] == "not" else node[1] if node[0] in ("and", "or", "cmp") else []
    for child in children:
        found = _first_leaf(child)
        if found is not None:
            return found
    return None


def verdict(plan: Plan, results: str) -> tuple[bool, str]:
    """(passed, reason) from the sandbox's result lines; every check must hold."""
    values: dict[int, tuple[bool, Any]] = {}
    done, step_error = False, ""
    for line in results.splitlines():
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
            if rec.get("done") is True and len(rec) == 1:
                done = True
            elif "step" in rec and isinstance(rec.get("error"), str):
                step_error = rec["error"]
            elif isinstance(rec.get("id"), int) and rec["id"] in plan.leaf_src and rec["id"] not in values:
                values[rec["id"]] = (True, decode(rec["value"])) if "value" in rec else (False, str(rec["error"]))
            else:
                raise ValueError("unexpected record")
        except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as exc:
            return False, f"malformed test results: {type(exc).__name__}: {str(exc)[:100]}"
    if step_error:
        return False, f"test raised {step_error}"
    if not done:
        return False, "the test harness did not finish (the program left early)"
    for check in plan.checks:
        try:
            if not _evaluate(check.tree, values):
                leaf = _first_leaf(check.tree)
                got = f" (got {values[leaf][1]!r:.80})" if leaf is not None else ""
                return False, f"assertion failed: {check.src[:120]}{got}"
        except _Failed as exc:
            reason = str(exc)
            return False, reason if reason.startswith("the test harness") else f"test raised {reason}"
        except Exception as exc:  # comparing the values failed (TypeError, ...): not a pass
            return False, f"assertion failed: {check.src[:120]}: {type(exc).__name__}: {str(exc)[:100]}"
    return True, ""
