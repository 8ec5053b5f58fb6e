"""LaTeX answer boxes: the contents of every outermost `\\boxed{...}` / `\\fbox{...}`, braces balanced,
found in one pass (shared by the numeric grader, math.py, and the expression grader, math_expr.py)."""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the contents of every outermost `\\boxed{...}` / `\\fbox{...}`, braces
    balanced; one pass over the text (nested boxes are inside their outer box's span)."""
    spans, i = [], 0
    for m in _BOX.finditer(text):
        if m.start() < i:
            continue  # inside the previous box
        depth, j = 1, m.end()
        while j < len(text) and depth:
            c = text[j]
            depth += 1 if c == "{" else -1 if c == "}" else 0
            j += 1
        if depth:
            break  # unclosed: so is every later box (they are all inside it)
        spans.append((m.end(), j - 1))
        i = j
    return spans


def boxed_contents(text: str) -> list[str]:
    """The contents of every outermost `\\boxed{...}` (and `\\fbox{...}`), braces balanced."""
    return [text[a:b] for a, b in boxed_spans(text)]
