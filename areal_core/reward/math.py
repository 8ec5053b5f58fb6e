"""Math verifiers: GSM8K final-answer match and a general expression check via math-verify."""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:/\d+)?"
_ENDINGS = [
    re.compile(r"####\s*(" + _NUM + ")"),
    re.compile(r"\\boxed\{\s*(" + _NUM + r")[^}]*\}"),
    re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(" + _NUM + ")", re.IGNORECASE),
]
_ANY_NUMBER = re.compile(_NUM)


def parse_number(text: str) -> Fraction | None:
    """'$1,234.50' -> Fraction(2469, 2); None when `text` holds no number."""
    m = _ANY_NUMBER.search(text)
    if not m:
        return None
    s = m.group(0).replace("$", "").replace(",", "").replace(" ", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> Fraction | None:
    """The final answer of a completion: `#### N`, `\\boxed{N}`, 'the answer is N', else the last number."""
    for pattern in _ENDINGS:
        found = pattern.findall(completion)
        if found:
            return parse_number(found[-1])
    numbers = _ANY_NUMBER.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(reference: str) -> Fraction | None:
    """A GSM8K solution's `#### N`, or the reference itself when it is a bare number."""
    if "####" in reference:
        return parse_number(reference.rsplit("####", 1)[1])
    return parse_number(reference)


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer equals the reference's numerically, else 0.0."""
    got, want = extract_answer(completion), reference_answer(reference)
    return 1.0 if got is not None and want is not None and got == want else 0.0


def math_reward(completion: str, reference: str) -> float:
    """Expression-level equivalence (LaTeX, fractions, sets) by math-verify; 1.0 or 0.0."""
    from math_verify import parse, verify

    gold = parse(reference)
    pred = parse(completion)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0
