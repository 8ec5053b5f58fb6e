"""Grading expression answers (MATH, MATH-500): π, radicals, polynomials, equations, tuples,
sets, intervals, matrices, choices, against the whole reference, by math-verify.

The reference is LaTeX whether or not it is `$`-wrapped (MATH's `answer` field writes it bare).
The completion's deciding text is, in order: every `\\boxed{}` (with the rest of the last box's
line), else every `####` line, else each "the answer is ..." line, else the last `$...$` /
`\\(...\\)` / `\\[...\\]` segment, else the last line. Every value that text offers must be the
reference's answer, or it scores 0:

    a hedge word outside the math (or, either, unless, else, otherwise, alternatively, instead,
    maybe, perhaps, possibly, probably, approximately, about, at least, at most), or ±, ≈,
    \\pm, \\approx, \\lor, where the reference has none
    several math segments, boxes or answer lines: each one must verify
    several answers in one piece (`a \\\\ b`, `a \\quad b`, `a \\text{ and } b`, rows of `cases`): each one must
    verify (areal_core/reward/math_answers.py, math_split.py)
    an equation or relation between two different expressions: every side must verify or only name the
    answer, and one must verify (`x = 5` pays for 5; `x^2-1 = x^2+1` does not pay for x^2+1, nor
    `\\frac{\\pi}{6} = \\frac{\\pi}{3}` for either)
    a base other than the reference's (`10_8` for `10_9`: math-verify drops subscripts)

Each piece is parsed as `$piece$`, at most math_answers.MAX_PIECE characters, at most MAX_PIECES per
completion, each parse and verify under math-verify's timeout.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING

from areal_core.reward.latex import boxed_spans

if TYPE_CHECKING:
    from areal_core.reward.math_answers import Reference

MAX_PIECES = 6

# words that offer another value or qualify one: hedges in the deciding text, and (with more) after it
_HEDGING = (
    r"or|either|unless|else|otherwise|alternatively|instead|maybe|perhaps|possibly|probably|roughly|about|around|nearly"
)
_HEDGE_WORDS = re.compile(
    rf"\b(?:{_HEDGING}|approx(?:imately)?|could|might|but|at[ \t]+(?:least|most))\b", re.IGNORECASE
)
_HEDGE_SIGNS = re.compile(r"±|≈|∨|\\(?:pm|mp|approx|lor|vee)(?![a-zA-Z])")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_CMD = re.compile(r"\\[a-zA-Z]+")
# bounded segments: an unclosed `\(` scans at most 2,000 characters, never the rest of the text
_MATH_SEGMENT = re.compile(
    r"\$\$(.{1,2000}?)\$\$|\$(.{1,2000}?)\$|\\\((.{1,2000}?)\\\)|\\\[(.{1,2000}?)\\\]", re.DOTALL
)
MAX_DEPTH = 10  # brace nesting of a piece (math-verify's parse grows steeply with it)
_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\}|\\,)(?=\d{3}(?!\d))")  # 10,\!000 (MATH's numbers)
_LONG_DECIMAL = re.compile(r"\d\.\d{3,}")
_TEXT_CONTENT = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|textrm|texttt|textsf)\s*\{([^{}]*)\}")
_HASH_LINE = re.compile(r"####[ \t]*([^\n]*)")
_PHRASE_LINE = re.compile(
    r"(?:final[ \t]+answer|the[ \t]+answer|answer)[ \t]*(?:is|:|=|would[ \t]+be|will[ \t]+be|should[ \t]+be)[ \t]*:?"
    r"([^\n]*)",
    re.IGNORECASE,
)
# a number's base, as MATH writes it (1011_2, 10_{8}, A3F_{16}; not a name's index, x_1): math-verify drops it,
# so it is compared here
_BASE = re.compile(r"(?<=[0-9A-F}])_\{?(\d+)\}?")


def _words(text: str) -> str:
    """The prose of a LaTeX text: \\text{} contents kept, other commands removed."""
    return _LATEX_CMD.sub(" ", _TEXT_CMD.sub(r" \1 ", text))


def hedges(text: str, reference: str) -> bool:
    """A hedge word or sign in `text` that the reference does not itself contain, or a value
    written outside ASCII in the prose (`but could be π`, a full-width digit)."""
    if _HEDGE_SIGNS.search(text) and not _HEDGE_SIGNS.search(reference):
        return True
    if any(ord(c) > 127 and unicodedata.category(c)[0] in "LNS" for c in _words(text)):
        return True
    return bool(_HEDGE_WORDS.search(_words(text))) and not _HEDGE_WORDS.search(_words(reference))


def _unwrap(reference: str) -> str:
    """The reference's LaTeX without its `$`, `\\(`, `\\[` or `\\boxed{}` wrapping, MATH's
    thousands separators (`10,\\!000`) removed."""
    ref = _THOUSANDS.sub("", reference.strip())
    boxes = boxed_spans(ref)
    if len(boxes) == 1:
        ref = ref[boxes[0][0] : boxes[0][1]]
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ref.startswith(left) and ref.endswith(right) and len(ref) >= len(left) + len(right):
            ref = ref[len(left) : len(ref) - len(right)].strip()
    return ref


def piece_matches(piece: str, ref: Reference) -> bool:
    """One answer piece (LaTeX, no `$`) against the reference: each answer it names, equations and their sides
    included (areal_core/reward/math_answers.py)."""
    from areal_core.reward.math_answers import answer_pays

    piece = _THOUSANDS.sub("", piece.strip().rstrip(".").strip())
    if not piece or _depth(piece) > MAX_DEPTH:
        return False
    if sorted(_BASE.findall(piece)) != sorted(_BASE.findall(ref.latex)):  # 10_8 is not 10_9
        return False
    if "." not in ref.latex and _LONG_DECIMAL.search(piece):  # 6.283185 for 2π: an approximation
        return False
    if "\\text" not in ref.latex and any(re.search(r"[^A-Za-z ]", t) for t in _TEXT_CONTENT.findall(piece)):
        return False  # `2\pi \text{(}\pi\text{)}`: text that is not words hides a value
    return answer_pays(piece, ref)


def _depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        depth += 1 if c == "{" else -1 if c == "}" else 0
        deepest = max(deepest, depth)
    return deepest


def _deciding_texts(completion: str) -> tuple[list[str], list[str]]:
    """(pieces that must each verify, prose around them that must not hedge)."""
    boxes = boxed_spans(completion)
    pieces: list[str] = []
    prose: list[str] = []
    if boxes:
        end = completion.find("\n", boxes[-1][1])
        tail = completion[boxes[-1][1] + 1 : end if end >= 0 else len(completion)]
        pieces = [completion[a:b] for a, b in boxes]
        segments = [_segment(m) for m in _MATH_SEGMENT.finditer(tail)]
        pieces += [s for s in segments if s.strip() and "\\boxed" not in s]
        prose = [_MATH_SEGMENT.sub(" ", tail), *pieces]
    # every marker kind the completion uses must agree: a box and a `####` line, or an answer phrase
    lines = [part for m in _HASH_LINE.finditer(completion) for part in m.group(1).split("####")]
    lines += [m.group(1) for m in _PHRASE_LINE.finditer(completion) if "\\boxed" not in m.group(1)]
    if lines:
        for line in lines:
            segments = [_segment(m) for m in _MATH_SEGMENT.finditer(line)]
            pieces += segments or [line]
            prose.append(_MATH_SEGMENT.sub(" ", line) if segments else line)
    if pieces:
        return pieces, prose
    segments = list(_MATH_SEGMENT.finditer(completion))
    if segments:
        last = segments[-1]
        line_start = completion.rfind("\n", 0, last.start()) + 1
        line_end = completion.find("\n", last.end())
        line = completion[line_start : line_end if line_end >= 0 else len(completion)]
        return [_segment(m) for m in _MATH_SEGMENT.finditer(line)], [_MATH_SEGMENT.sub(" ", line)]
    last_line = next((ln for ln in reversed(completion.splitlines()) if ln.strip()), "")
    return [last_line], [last_line]


def _segment(match: re.Match[str]) -> str:
    return next(g for g in match.groups() if g is not None)


def math_segments(text: str) -> list[str]:
    """The contents of the `$..$`, `$$..$$`, `\\(..\\)` and `\\[..\\]` segments of `text`, in order."""
    return [_segment(m) for m in _MATH_SEGMENT.finditer(text)]


# After the final answer only prose may follow: no math, digits, commands, single-letter values,
# or words that add or qualify a value (in any of these languages' "or").
_TAIL_MATH = re.compile(r"[0-9$\\^_{}=|/<>+*~±≈∞]|\([A-Za-z]\)|(?<![A-Za-z'])(?![aAI]\b)[A-Za-z](?![A-Za-z'])")
_TAIL_WORDS = re.compile(
    rf"\b(?:{_HEDGING}|approx\w*|negative|positive|sign|signs|opposite|reciprocal|inverse|conjugate|plus|minus|"
    r"also|and|times|over|ou|oder|oppure|sinon|bzw|of)\b",
    re.IGNORECASE,
)
_MAX_TAIL = 200
_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
# what may stand before a box inside its math segment: nothing, or a name and `=` ("x =", "p(x) =")
_BOX_PREFIX = re.compile(r"^\s*(?:(?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?(?:\([^()]*\))?\s*=\s*)?$")


def commits(completion: str, reference: str) -> bool:
    """False when the completion's final answer is not committed to: a box that is unbraced,
    unclosed or nested, a box that is only part of its math segment (`$-\\boxed{a}$`), or anything
    but plain prose after the last marker (`\\boxed{a}, b`, `\\boxed{a}` then `Or maybe $b$`)."""
    boxes = boxed_spans(completion)
    if len(_BOX_TOKEN.findall(completion)) != len(boxes) or any(_BOX_TOKEN.search(completion, a, b) for a, b in boxes):
        return False
    for m in _MATH_SEGMENT.finditer(completion):
        inner = _segment(m)
        start = m.start() + m.group(0).index(inner)
        for a, b in boxes:
            if start <= a and b <= start + len(inner):
                before = completion[start : completion.rfind("\\", start, a)]
                after = completion[b + 1 : start + len(inner)]
                if not _BOX_PREFIX.match(before) or after.strip(" .,;:!\\") or _TAIL_MATH.search(after):
                    return False
    ends = [b + 1 for _, b in boxes] + [m.end() for m in _HASH_LINE.finditer(completion)]
    ends += [m.end() for m in _PHRASE_LINE.finditer(completion)]
    if not ends:
        return True
    tail = completion[max(ends) :]
    tail = tail[tail.index("$") + 1 :] if tail.lstrip().startswith("$") else tail  # the box's own segment closing
    tail = tail.replace("\\]", " ").replace("\\)", " ")
    return len(tail) <= _MAX_TAIL and not _TAIL_MATH.search(tail) and not _TAIL_WORDS.search(_words(tail))


def expression_reward(completion: str, reference: str) -> float:
    """1.0 when every value the completion's deciding text offers is the reference's answer, else 0.0."""
    from areal_core.reward.math_answers import read_reference

    ref = _unwrap(reference)
    if not commits(completion, ref):
        return 0.0
    reference_read = read_reference(ref)
    if reference_read is None:
        return 0.0
    pieces, prose = _deciding_texts(completion)
    pieces = list(dict.fromkeys(p.strip() for p in pieces if p.strip()))
    if not pieces or len(pieces) > MAX_PIECES:
        return 0.0
    if any(hedges(text, ref) for text in prose):
        return 0.0
    return 1.0 if all(piece_matches(p, reference_read) for p in pieces) else 0.0
