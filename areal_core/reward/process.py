"""Process rewards for worked solutions: every arithmetic step is checked, one reward a step.

A *step* is either

* a calculator annotation `<<expr=v>>` (the GSM8K format: "She pays 3*4=<<3*4=12>>12 dollars"), or
* a line that is nothing but an equation `expr = v` (the embedded arithmetic task's format:
  "9+5=14\\n14-8=6\\n#### 6").

`expr` is evaluated without `eval`: it is parsed with `ast` and only numbers, `+ - * /`, unary
signs and parentheses are allowed (anything else makes the step *unchecked*, never run).
Arithmetic is exact (`fractions.Fraction`); a claimed value with d decimals is accepted when it
is `expr` rounded to d decimals (`<<10/3=3.33>>`), an integer claim must be exact.

`process_reward` combines the steps with the outcome reward (GSM8K final answer by default):

    reward = outcome − step_weight · (wrong steps / checked steps)

so a wrong step always costs, and correct steps never lift a wrong final answer above 0.
With `token_offsets` (the end character of each response token in `completion`, see
`token_end_offsets`) it also returns dense `token_rewards` over the whole row (`prompt_len`
zeros, then one value per response token): the outcome on the last response token and
−step_weight / checked on the last token of each wrong step, so that
`sum(token_rewards) == reward`. Without offsets, `info["steps"]` carries each step's
character span and verdict.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from areal_core.config.hooks import import_object
from areal_core.reward.math import gsm8k_reward

MAX_EXPR_CHARS = 200
MAX_EXPR_NODES = 64
MAX_DIGITS = 400  # an intermediate result longer than this is refused (no huge-int DoS)

_ANNOTATION = re.compile(r"<<([^<>=\n]{1,200})=([^<>=\n]{1,60})>>")
_EQUATION_LINE = re.compile(
    r"^[ \t]*([\d \t.,$+\-*/×÷−()]{3,200}?)[ \t]*=[ \t]*([-−]?\$?[\d.,]+)[ \t]*\.?[ \t]*$", re.M
)
_HAS_OPERATOR = re.compile(r"\d\s*[-+*/×÷−]\s*[\d(.]")


class UnsafeExpression(ValueError):
    """The expression is not plain arithmetic (names, calls, powers, too long...)."""


def _normalize(expr: str) -> str:
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-").replace("$", "")
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expr)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            out = left + right
        elif isinstance(node.op, ast.Sub):
            out = left - right
        elif isinstance(node.op, ast.Mult):
            out = left * right
        else:
            if right == 0:
                raise UnsafeExpression("division by zero")
            out = left / right
        if len(str(out.numerator)) + len(str(out.denominator)) > MAX_DIGITS:
            raise UnsafeExpression("result too large")
        return out
    raise UnsafeExpression(f"{type(node).__name__} is not allowed")


def safe_eval(expr: str) -> Fraction:
    """Exact value of an arithmetic expression of numbers, + - * /, signs and parentheses.

    Raises UnsafeExpression for anything else; never executes code.
    """
    expr = _normalize(expr).strip()
    if not expr or len(expr) > MAX_EXPR_CHARS:
        raise UnsafeExpression("empty or too long")
    if re.search(r"[^\d\s.+\-*/()]", expr):
        raise UnsafeExpression("characters other than numbers and + - * / ( )")
    if "**" in expr or "//" in expr:
        raise UnsafeExpression("only + - * / are allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeExpression(f"not an expression: {type(exc).__name__}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_EXPR_NODES:
        raise UnsafeExpression("expression too large")
    return _eval(tree)


def parse_claim(text: str) -> tuple[Fraction, int] | None:
    """'1,234.50' -> (Fraction(2469, 2), 2 decimals); None when it is not a plain number."""
    s = _normalize(text).strip().rstrip(".").replace(" ", "")
    if re.fullmatch(r"-?\d+/[1-9]\d*", s):
        return Fraction(s), 0
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    decimals = len(s.split(".", 1)[1]) if "." in s else 0
    return Fraction(s), decimals


def claim_matches(actual: Fraction, claimed: Fraction, decimals: int) -> bool:
    if actual == claimed:
        return True
    return decimals > 0 and abs(actual - claimed) <= Fraction(1, 2 * 10**decimals)


@dataclass
class Step:
    start: int  # character span of the step in the completion
    end: int
    kind: str  # "annotation" | "line"
    expr: str
    claimed: str
    ok: bool | None  # None: not checkable (not plain arithmetic); never executed
    reason: str = ""


def _check(start: int, end: int, kind: str, expr: str, claimed_text: str) -> Step:
    step = Step(start, end, kind, expr.strip(), claimed_text.strip(), None)
    claim = parse_claim(claimed_text)
    if claim is None:
        step.reason = "claimed value is not a number"
        return step
    try:
        actual = safe_eval(expr)
    except UnsafeExpression as exc:
        step.reason = str(exc)
        return step
    step.ok = claim_matches(actual, *claim)
    step.reason = "" if step.ok else f"{step.expr} is {float(actual):g}, not {step.claimed}"
    return step


def check_steps(completion: str) -> list[Step]:
    """Every annotation and equation line of `completion`, checked, in text order."""
    steps = [_check(m.start(), m.end(), "annotation", m.group(1), m.group(2)) for m in _ANNOTATION.finditer(completion)]
    for m in _EQUATION_LINE.finditer(completion):
        if _HAS_OPERATOR.search(m.group(1)) and not any(s.start < m.end() and m.start() < s.end for s in steps):
            steps.append(_check(m.start(1), m.end(2), "line", m.group(1), m.group(2)))
    return sorted(steps, key=lambda s: s.start)


def token_index(token_offsets: Sequence[int], char_end: int) -> int:
    """The response token that holds character `char_end - 1` (the last token when past the end)."""
    for i, end in enumerate(token_offsets):
        if end >= char_end:
            return i
    return len(token_offsets) - 1


def token_end_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """End character (in `tokenizer.decode(ids, skip_special_tokens=True)`) of each token.

    Per-token decodes when they concatenate to the whole text (byte-level BPE on ASCII);
    otherwise prefix decodes (exact for any tokenizer, quadratic in length).
    """
    ids = list(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    if "".join(pieces) == text:
        out, total = [], 0
        for p in pieces:
            total += len(p)
            out.append(total)
        return out
    out, last = [], 0
    for n in range(1, len(ids) + 1):
        last = max(last, min(len(tokenizer.decode(ids[:n], skip_special_tokens=True)), len(text)))
        out.append(last)
    return out


def wants_token_offsets(fn: Callable[..., Any] | str) -> bool:
    """Whether a reward function (or its 'pkg.module:function' path) takes `token_offsets`;
    the reward worker computes offsets only for those (they cost a decode per token)."""
    if isinstance(fn, str):
        fn = import_object(fn, key="reward.function")
    try:
        return "token_offsets" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def process_reward(
    completion: str,
    reference: str,
    token_offsets: Sequence[int] | None = None,
    prompt_len: int = 0,
    step_weight: float = 0.5,
    outcome: Callable[[str, str], float] = gsm8k_reward,
) -> dict[str, Any]:
    """Outcome reward with a penalty for wrong arithmetic steps; a RewardPool-ready dict.

    Returns {"reward", "info"} and, when `token_offsets` is given, "token_rewards" of
    length `prompt_len + len(token_offsets)` that sums to "reward".
    """
    steps = check_steps(completion)
    checked = [s for s in steps if s.ok is not None]
    wrong = [s for s in checked if not s.ok]
    outcome_value = float(outcome(completion, reference))
    penalty = step_weight / len(checked) if checked else 0.0
    reward = outcome_value - penalty * len(wrong)
    info: dict[str, Any] = {
        "outcome": outcome_value,
        "steps_checked": len(checked),
        "steps_wrong": len(wrong),
        "steps_unchecked": len(steps) - len(checked),
        "step_rewards": [None if s.ok is None else (1.0 if s.ok else 0.0) for s in steps],
        "steps": [asdict(s) for s in steps],
    }
    out: dict[str, Any] = {"reward": reward, "info": info}
    if token_offsets is not None:
        response = [0.0] * len(token_offsets)
        if response:
            response[-1] += outcome_value
            for s in wrong:
                response[token_index(token_offsets, s.end)] -= penalty
        out["token_rewards"] = [0.0] * prompt_len + response
    return out


def step_accuracy(completion: str) -> float:
    """Fraction of checkable steps that are right (0.0 when there is none): a reward by itself."""
    checked = [s for s in check_steps(completion) if s.ok is not None]
    return sum(s.ok for s in checked) / len(checked) if checked else 0.0
