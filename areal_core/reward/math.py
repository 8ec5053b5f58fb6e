"""Math verifiers: GSM8K final-answer match and a general expression check via math-verify.

`gsm8k_reward(completion, reference) -> 1.0 | 0.0` finds the completion's final answer, in
this order of precedence (the last occurrence of each wins):

1. `#### N` (the GSM8K reference format),
2. `\\boxed{N}` (balanced braces; `\\frac{a}{b}`, `\\text{..}`, `\\$`, `\\%`, `{,}` understood),
3. "the answer is N", "final answer: N", "Answer = N" (first number after the phrase),
4. otherwise the last number in the text.

A number tolerates a sign (`-`, `−`), currency (`$ € £ ¥`, before or after the sign),
thousands separators (`1,234,567`, `1{,}234`, `1\\,234`), decimals (`3.50`, `.5`), a
fraction `a/b`, and whatever follows it (`km`, `%`, `dollars`). Comparison is exact on
rationals: `18.0 == 18`, `0.5 == 1/2`. A separator that is not a thousands group
(`3,4`) splits numbers. Number words ("twelve") are not read.
"""

from __future__ import annotations

import re
from fractions import Fraction

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A minus counts as a sign only where it cannot be a binary operator (not after a word, digit or bracket).
_SIGN = r"(?:(?<![\w)\]}.])[-−]\s?)?"
_CUR = r"(?:[$€£¥]\s?(?P<s2>[-−]\s?)?)?"  # a sign after the currency: "$-5"
_NUMBER = re.compile(r"(?P<s1>" + _SIGN + r")" + _CUR + r"(?P<num>" + _DIGITS + r")(?:\s?/\s?(?P<den>\d+)(?![\d.]))?")
_HASH = re.compile(r"####")
_ANSWER_PHRASE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:|=|would\s+be|will\s+be|should\s+be)\s*:?", re.IGNORECASE
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _clean(text: str) -> str:
    """LaTeX and typography noise around numbers -> plain text."""
    text = text.replace("{,}", ",").replace("\\,", ",").replace("\\!", "").replace("\\ ", " ")
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text)
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = text.replace("\\$", "$").replace("\\%", "%").replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\((\s*-?\d+(?:\.\d+)?\s*)\)/\((\s*\d+\s*)\)", r"\1/\2", text)  # (a)/(b) from \frac
    return text.replace("\u2212", "-").replace("\u00a0", " ").replace("\u202f", " ")


def _to_fraction(match: re.Match[str]) -> Fraction | None:
    negative = bool(match.group("s1")) != bool(match.group("s2"))
    try:
        value = Fraction(match.group("num").replace(",", ""))
        if match.group("den"):
            value /= int(match.group("den"))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if negative else value


def parse_number(text: str) -> Fraction | None:
    """The first number in `text`: '$1,234.50' -> Fraction(2469, 2); None when there is none."""
    m = _NUMBER.search(_clean(text))
    return _to_fraction(m) if m else None


def last_number(text: str) -> Fraction | None:
    found = list(_NUMBER.finditer(_clean(text)))
    return _to_fraction(found[-1]) if found else None


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (and `\\fbox{...}`), braces balanced."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def extract_answer(completion: str) -> Fraction | None:
    """The final answer of a completion (see the module docstring for the precedence)."""
    hashes = list(_HASH.finditer(completion))
    if hashes:
        value = parse_number(completion[hashes[-1].end() :].split("\n", 1)[0])
        if value is not None:
            return value
    for content in reversed(boxed_contents(completion)):
        value = parse_number(content)
        if value is not None:
            return value
    phrases = list(_ANSWER_PHRASE.finditer(completion))
    if phrases:
        value = parse_number(completion[phrases[-1].end() :][:120])
        if value is not None:
            return value
    return last_number(completion)


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
    """Expression-level equivalence (LaTeX, fractions, sets) by math-verify; 1.0 or 0.0.

    A GSM8K-style reference (`... #### N`) is reduced to N first; when math-verify cannot
    parse either side, the numeric GSM8K comparison decides.
    """
    from math_verify import parse, verify

    if "####" in reference:
        reference = reference.rsplit("####", 1)[1].strip().replace(",", "")
    gold = parse(reference)
    pred = parse(completion)
    if gold and pred:
        return 1.0 if verify(gold, pred) else 0.0
    return gsm8k_reward(completion, reference)
