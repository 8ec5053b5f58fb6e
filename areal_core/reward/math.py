"""Math verifiers: GSM8K final-answer match and a general expression check via math-verify.

One final answer or none. `final_answer(completion)` finds the deciding marker, in this order
of precedence (the first kind the completion contains, with a value, decides):

1. `#### N` (the GSM8K reference format): the rest of each `####` line;
2. `\\boxed{N}` / `\\fbox{N}` (balanced braces; `\\frac{a}{b}`, `\\text{..}`, `\\$`, `\\%`, `{,}`
   understood): each box's contents, and the rest of the line after the last box;
3. "the answer is N", "final answer: N", "Answer = N", "answer would be N": the rest of the
   line after each phrase;
4. otherwise the last number in the text (the last line that has one decides whether it is
   hedged).

The answer is *hedged*, and scores 0, when the deciding text names more than one distinct value:
two numbers in one span (`#### 18, 3`, `The answer is either 18 or 3.`, `#### 18 or 19`,
`\\boxed{18} or 3`, `answer is 7 apples and 3 pears`), occurrences of markers that
disagree (`\\boxed{3} ... \\boxed{5}`, two `####` lines, `#### 18` then `the answer is 19`), or, without a
marker, a last line that hedges with or/either/maybe/between (`It is 3 or 18.`). One value made a range or an estimate
hedges too: a deciding span with `or more`, `at least`, `about`, `≈`, `~`, `\\geq`, `18+`, or a
number word next to `or` (`#### 18 or more`, `\\boxed{\\approx 18}`); a last line without a
marker only when its last number is so qualified (`at least 18`, `about 18`, `18 or more`). The same value written twice
(`\\boxed{18} ... \\boxed{18.0}`) is one value.

A number tolerates a sign (`-`, `−`), currency (`$ € £ ¥`, before or after the sign),
thousands separators (`1,234,567`, `1{,}234`, `1\\,234`), decimals (`3.50`, `.5`), a fraction
`a/b`, and a unit after it (`km`, `dollars`, `%`: a percent sign is read as a unit and never
divides, so `1800%` is 1800, not 18). Comparison is exact on rationals: `18.0 == 18`,
`0.5 == 1/2`. A separator that is not a thousands group (`3,4`, `1 000`) splits numbers, so
the answer names two. Number words ("twelve") are not read.

Every step is linear in the completion's length (one pass for braces, regular expressions
without nested quantifiers over the same characters), so a megabyte of adversarial text
grades in a fraction of a second; math-verify only ever sees the deciding span, capped at
`MAX_SPAN` characters, under its own timeout.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

from areal_core.reward.latex import boxed_contents, boxed_spans
from areal_core.reward.math_expr import commits, expression_reward, math_segments

__all__ = ["boxed_contents", "boxed_spans", "final_answer", "gsm8k_reward", "math_reward"]

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A minus counts as a sign only where it cannot be a binary operator (not after a word, digit or bracket).
_SIGN = r"(?:(?<![\w)\]}.])[-−]\s?)?"
_CUR = r"(?:[$€£¥]\s?(?P<s2>[-−]\s?)?)?"  # a sign after the currency: "$-5"
_NUMBER = re.compile(r"(?P<s1>" + _SIGN + r")" + _CUR + r"(?P<num>" + _DIGITS + r")(?:\s?/\s?(?P<den>\d+)(?![\d.]))?")
_HASH = re.compile(r"####")
_DIGIT = re.compile(r"\d")
_ANSWER_PHRASE = re.compile(
    r"(?:final[ \t]+answer|the[ \t]+answer|answer)[ \t]*(?:is|:|=|would[ \t]+be|will[ \t]+be|should[ \t]+be)[ \t]*:?",
    re.IGNORECASE,
)
_HEDGE = re.compile(r"\b(?:or|either|maybe|perhaps|possibly|probably|between)\b|\\(?:lor|vee|pm)\b|±", re.IGNORECASE)
# Words and signs that make one number a range or an estimate ("18 or more", "at least 18", "≈18",
# "18+"): a deciding span with one of them is hedged even when it names a single value.
# _ESTIMATE hedges even a last line without a marker; _QUALIFIER_WORDS also an expression for
# math-verify (where `\\geq`, `<`, `+` can be the answer); _QUALIFIER any marked number.
_ESTIMATE = r"\b(?:approx(?:imately)?|roughly|at[ \t]+(?:least|most)|or[ \t]+(?:more|less|so))\b|≈|\\approx\b"
_WORDS = r"\b(?:about|around|nearly|almost|maybe|perhaps|possibly|probably|(?:more|less|fewer)[ \t]+than|up[ \t]+to)\b"
# Around the last number of a line without a marker (only there: "at least 3 trips, so 18" is fine).
_ESTIMATE_BEFORE = re.compile(r"(?:" + _ESTIMATE + r"|\b(?:about|around|nearly|almost)\b|~)[ \t]*$", re.IGNORECASE)
_ESTIMATE_AFTER = re.compile(r"[ \t]*(?:\+(?![ \t]*[\d.$(])|or[ \t]+(?:more|less|so)\b)", re.IGNORECASE)
_QUALIFIER_WORDS = re.compile(_ESTIMATE + "|" + _WORDS, re.IGNORECASE)
_QUALIFIER = re.compile(
    _ESTIMATE + "|" + _WORDS + r"|\b(?:or|either|between)\b|[~≥≤±]|\\(?:pm|lor|vee|geq?|leq?)\b"
    r"|\d[ \t]*\+(?![ \t]*[\d.$(])",
    re.IGNORECASE,
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac[ \t]*\{([^{}]*)\}[ \t]*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)[ \t]*\{([^{}]*)\}")
_PAREN_FRAC = re.compile(r"\(( ?-?\d+(?:\.\d+)? ?)\)/\(( ?\d+ ?)\)")  # (a)/(b) from \frac
MAX_SPAN = 500  # characters of a deciding span that math-verify parses (after the hedge checks on all of it)


def _clean(text: str) -> str:
    """LaTeX and typography noise around numbers -> plain text."""
    text = text.replace("{,}", ",").replace("\\,", ",").replace("\\!", "").replace("\\ ", " ")
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text)
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = text.replace("\\$", "$").replace("\\%", "%").replace("\\left", "").replace("\\right", "")
    text = _PAREN_FRAC.sub(r"\1/\2", text)
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


def distinct_values(text: str, stop_after: int = 2) -> list[Fraction]:
    """The distinct numbers of `text` in order of first appearance, at most `stop_after`
    (enough to tell one value from a hedge); each distinct spelling is converted once."""
    seen: dict[str, Fraction | None] = {}
    values: list[Fraction] = []
    for m in _NUMBER.finditer(_clean(text)):
        if m.group() in seen:
            continue
        seen[m.group()] = value = _to_fraction(m)
        if value is not None and value not in values:
            values.append(value)
            if len(values) >= stop_after:
                break
    return values


def parse_number(text: str) -> Fraction | None:
    """The first number in `text`: '$1,234.50' -> Fraction(2469, 2); None when there is none."""
    m = _NUMBER.search(_clean(text))
    return _to_fraction(m) if m else None


def last_number(text: str) -> Fraction | None:
    last = deque(_NUMBER.finditer(_clean(text)), maxlen=1)
    return _to_fraction(last[0]) if last else None


def _estimated_last(text: str) -> bool:
    """True when the last number of `text` is qualified as an estimate or a bound: "at least 18",
    "≈ 18", "about $18", "18+", "18 or more" (the qualifier right next to the number)."""
    clean = _clean(text)
    last = deque(_NUMBER.finditer(clean), maxlen=1)
    if not last:
        return False
    m = last[0]
    return bool(_ESTIMATE_BEFORE.search(clean, max(0, m.start() - 40), m.start())) or bool(
        _ESTIMATE_AFTER.match(clean, m.end())
    )


def _line_rest(text: str, start: int, stop: int | None = None) -> str:
    """From `start` to the end of its line, or to `stop` if that comes first."""
    end = text.find("\n", start, len(text) if stop is None else stop)
    return text[start : end if end >= 0 else len(text) if stop is None else stop]


def _marker_spans(text: str, pattern: re.Pattern[str]) -> list[str]:
    """The text after each match of `pattern` to the end of its line or the next match:
    the spans never overlap, so together they are at most as long as the text."""
    spans, start = [], None
    for m in pattern.finditer(text):
        if start is not None:
            spans.append(_line_rest(text, start, m.start()))
        start = m.end()
    if start is not None:
        spans.append(_line_rest(text, start))
    return spans


@dataclass
class Answer:
    """The deciding text of a completion, and the distinct values it names."""

    kind: str  # "####", "boxed", "phrase" or "last number"
    spans: list[str]  # the deciding texts (one per occurrence of the marker)
    values: list[Fraction]  # distinct values named, in order of first appearance (at most 2)
    hedged: bool  # more than one distinct value, or a hedging last line

    @property
    def value(self) -> Fraction | None:
        """The one final answer, or None when there is none or it is hedged."""
        return self.values[0] if len(self.values) == 1 and not self.hedged else None


def _decide(kind: str, spans: list[str], tail: str = "") -> Answer | None:
    """The Answer from the spans of one marker kind; None when no span names a value. A span
    with a value (or the `tail` after the last box) that qualifies it (`_QUALIFIER`) hedges."""
    values: list[Fraction] = []
    qualified = bool(tail and _QUALIFIER.search(_clean(tail)))
    for span in spans:
        if not _DIGIT.search(span):
            continue
        qualified = qualified or bool(_QUALIFIER.search(_clean(span)))
        for v in distinct_values(span):
            if v not in values:
                values.append(v)
        if len(values) > 1:
            break
    if not values:
        return None
    return Answer(kind, spans, values, hedged=len(values) > 1 or qualified)


def final_answer(completion: str) -> Answer | None:
    """The completion's deciding span and values (see the module docstring); None without a number."""
    answers: list[Answer] = []
    for kind in ("####", "boxed", "phrase"):
        if kind == "####":
            spans = _marker_spans(completion, _HASH)
        elif kind == "boxed":
            boxes = boxed_spans(completion)
            spans = [completion[a:b] for a, b in boxes]
            if boxes:
                spans.append(_line_rest(completion, boxes[-1][1] + 1))  # "\boxed{18} or 3"
        else:
            spans = _marker_spans(completion, _ANSWER_PHRASE)
        answer = _decide(kind, spans, spans[-1] if kind == "boxed" and spans else "")
        if answer is not None:
            answers.append(answer)
    if answers:  # the first kind decides; another kind naming another value makes it a hedge
        first = answers[0]
        values = list(first.values)
        values += [v for a in answers[1:] for v in a.values if v not in values]
        return Answer(first.kind, first.spans, values[:2], first.hedged or len(values) > 1)
    for line in reversed(completion.splitlines()):
        value = last_number(line)
        if value is not None:
            hedged = bool(_HEDGE.search(line)) and len(distinct_values(line)) > 1 or _estimated_last(line)
            return Answer("last number", [line], [value], hedged)
    return None


def extract_answer(completion: str) -> Fraction | None:
    """The one final answer of a completion; None when there is none or it is hedged."""
    answer = final_answer(completion)
    return answer.value if answer else None


def reference_answer(reference: str) -> Fraction | None:
    """A GSM8K solution's `#### N`, or the reference itself when it is a bare number."""
    if "####" in reference:
        return parse_number(reference.rsplit("####", 1)[1])
    return parse_number(reference)


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's one final answer equals the reference's numerically, else 0.0."""
    got, want = extract_answer(completion), reference_answer(reference)
    return 1.0 if got is not None and want is not None and got == want else 0.0


def _strip_percent(text: str) -> str:
    return text.replace("\\%", "").replace("%", "")


_NOT_PLAIN = re.compile(r"[a-zA-Z^_{}()\[\]=*+\\]")  # anything that makes a span more than numbers
_RELATION = re.compile(r"[=<>≤≥≠≈∈]|\\(?:[gl]eq?|neq?|approx|sim|equiv|in)(?![a-zA-Z])")
_STRUCTURE = re.compile(r"[=<>≤≥≠≈∈;&|~]|\\")  # a relation, a separator or a command: a box read as answers
_PROSE_UNIT = re.compile(r"(?<=\d)[ \t]+([A-Za-z][A-Za-z ]*?)[ \t]*\.?$")  # "x = 18 dollars." -> 18 \text{dollars}


def _answers_pay(text: str, kind: str, reference: str) -> bool:
    """Every answer of a marked span (a box, or the math of a `####` or answer line) is the reference's number:
    `x + y = 3`, `\\pi = 3`, `x = 3 \\implies y` are not 3 (areal_core/reward/math_answers.py). The last line
    without a marker is prose, read as before."""
    from areal_core.reward.math_answers import answer_pays, read_reference

    pieces = [text] if kind == "boxed" else math_segments(text.replace("\\$", ""))  # `$\\$18$`: currency
    if kind == "last number" or not (_STRUCTURE if pieces else _RELATION).search(text):
        return True
    ref = read_reference(reference.strip().strip("$").strip())
    pieces = pieces or [_PROSE_UNIT.sub(r" \\text{\1}", text.strip())]
    return ref is not None and all(answer_pays(piece, ref) for piece in pieces)


def math_reward(completion: str, reference: str) -> float:
    """Expression-level equivalence (LaTeX, fractions, sets) by math-verify; 1.0 or 0.0.

    math-verify parses only the deciding spans of `final_answer` (each box's contents, each
    `####` line, each answer phrase's line, or the last line with a number), at most
    `MAX_SPAN` characters each and 4 distinct spans, and every one of them must be equivalent
    to the reference: boxes that disagree score 0. A span that hedges (or, either, maybe, ±,
    ...) or is nothing but more than one distinct number (`18, 3`) scores 0. A percent sign is
    a unit, never a division by 100. A GSM8K-style reference (`... #### N`) is reduced to N and
    a worked solution to its last box first; when math-verify cannot parse a side, the numeric
    GSM8K comparison decides. A box, or the math of a `####` or answer line, that names two answers
    or equates the number with another expression (`\\boxed{x + y = 3}`, `\\boxed{3 \\\\ \\pi}`) scores 0
    (`_answers_pay`). A reference that is not one number is an expression
    (areal_core/reward/math_expr.py: MATH's answers).
    """
    from math_verify import parse, verify

    if "####" in reference:
        reference = reference.rsplit("####", 1)[1].strip().replace(",", "")
    boxes = boxed_contents(reference)
    if boxes:  # a worked solution (MATH's `solution`, task_data/formats.py): its last box is the answer
        reference = boxes[-1]
    if not commits(completion, reference):  # a hedge after the answer, or a box inside an expression
        return 0.0
    numeric = _NUMBER.fullmatch(_clean(reference).strip().strip("$").strip()) is not None
    if not numeric:  # an expression (π, radicals, sets, intervals, equations, matrices): MATH's answers
        return expression_reward(completion, reference)
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    # One number is asked for (a numeric reference, or the GSM8K `####` format): a hedged
    # answer ("#### 18+", "\\boxed{\\geq 18}") scores 0 even where math-verify would accept it.
    if answer.hedged:
        return 0.0
    spans = answer.spans
    if answer.kind == "boxed":  # the boxes' contents; the rest of the last box's line may only not hedge
        spans, after = spans[:-1], spans[-1]
        if _HEDGE.search(after) or distinct_values(after, 1):
            return 0.0
    candidates = list(dict.fromkeys(_strip_percent(" ".join(s.split())) for s in spans if s.strip()))
    if not candidates or len(candidates) > 4:
        return 0.0
    for text in candidates:
        plain = _LATEX_TEXT.sub(r" \1 ", text)  # "\\approx 18", "18 \\text{ or more}"
        if _estimated_last(plain) if answer.kind == "last number" else _QUALIFIER_WORDS.search(plain):
            return 0.0
        plain_values = distinct_values(text)
        if len(plain_values) > 1 and (
            _HEDGE.search(_LATEX_TEXT.sub(r" \1 ", text)) or not _NOT_PLAIN.search(_clean(text).replace("$", ""))
        ):
            return 0.0
    if not all(_answers_pay(text, answer.kind, _strip_percent(reference)) for text in candidates):
        return 0.0
    gold = parse(_strip_percent(reference)[:MAX_SPAN], parsing_timeout=5)
    for text in candidates:
        # the last line without a marker: its end, where the answer is; otherwise the span's start
        text = text[-MAX_SPAN:] if answer.kind == "last number" else text[:MAX_SPAN]
        pred = parse(f"\\boxed{{{text}}}" if answer.kind == "boxed" else text, parsing_timeout=5)
        plain = _NUMBER.fullmatch(_clean(text).strip().strip("$").strip())
        if plain is not None:  # a number against a number: exactly (0.3333333 is not 1/3)
            ok = _to_fraction(plain) == parse_number(reference)
        elif gold and pred:
            ok = verify(gold, pred, timeout_seconds=5)
        else:
            ok = extract_answer(text) is not None and gsm8k_reward(text, reference) == 1.0
        if not ok:
            return 0.0
    return 1.0
