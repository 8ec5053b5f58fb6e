"""The answers inside one deciding piece of a math completion (a box's contents, a math segment), and whether
each of them is the reference's answer.

A piece names one answer per *part*: `\\\\`, `\\quad`, `\\mid`, `;`, `\\text{ and }`, `\\implies`, the rows of `cases`
and the like separate them (areal_core/reward/math_split.py), and so does `,` where the reference has no comma and
no `\\pm`.

A part may be an equation or a relation. Where the reference is an expression (no relation) or names its value
(`y = 2x + 1`, `x \\in [-2, 7]`), a part's relations may only be `=` or `\\in`, and every side must either be
equivalent to the reference's value or only name it (`y`, `f(x)`, `x_1`, `\\theta`: not a constant and not a
variable of the value itself), with at least one side equivalent:

    x^2+1 = x^2+1 ... pays for x^2+1 (one value, written twice)        y = x^2+1, f(x) = x^2+1 pay
    x^2-1 = x^2+1, x^2+1 = 5, x = x^2+1, x^2+1 \\ge 0, y = 3x = 2x + 1 score 0

A single equation against a named reference is also compared as an equation (`2x - y + 1 = 0` for `y = 2x + 1`).
A reference that is another relation (`x > 3`, `x^2 + y^2 = 25`) is compared whole, and a part with more relations
than it scores 0. Every comparison is math-verify's `parse` and `verify`: this module only decides which pieces of
the answer are compared with which part of the reference (math-verify itself takes the right side of any equation
it is given, so `x^2-1 = x^2+1` would pay for x^2+1, and it reads `a \\\\ b` as its last line).

Every part must pay; a bare list reference (`1, 2`, `x = 1, 2`) is instead paid when the parts' values are exactly
its elements (`x = 1, x = 2` and `2 \\\\ 1` pay; `1, 2, 3` does not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from areal_core.reward.math_split import EQUALS_LIKE, MAX_PARTS, NAME, relation_split, split_answers

MAX_PIECE = 500  # characters of one piece math-verify parses
TIMEOUT_S = 5  # math-verify's parse and verify timeouts

MAX_SIDES = 4  # sides of an equation chain
MAX_ELEMENTS = MAX_PARTS  # elements of a listed reference matched one by one (a longer list is compared whole)


def parse_latex(latex: str) -> list[Any]:
    """math-verify's parse of `$latex$` (at most MAX_PIECE characters), [] when it cannot."""
    from math_verify import parse

    return parse(f"${latex[:MAX_PIECE]}$", parsing_timeout=TIMEOUT_S)


def _verifies(gold: list[Any], pred: list[Any]) -> bool:
    from math_verify import verify

    return bool(gold and pred and verify(gold, pred, timeout_seconds=TIMEOUT_S))


def same_value(gold: list[Any], latex: str) -> bool:
    """math-verify: is `latex` equivalent to the parsed `gold`?"""
    return _verifies(gold, parse_latex(latex))


@dataclass(frozen=True)
class Reference:
    """A reference answer read once: its parse, the value a bare answer is compared with, its shape."""

    latex: str
    gold: list[Any]  # the whole reference, parsed
    value: list[Any]  # what a bare answer must equal: the whole, or `2x + 1` of `y = 2x + 1`
    relations: list[str]  # the reference's own top-level relations, when it is not `name = value`
    elements: list[list[Any]]  # a bare list's elements (`1, 2`), each parsed; else []
    variables: frozenset[Any]  # the value's free symbols: a side that is one of them names nothing
    commas: bool  # a comma in an answer separates answers (the reference has none and no `\\pm`)


def read_reference(latex: str) -> Reference | None:
    """The reference `latex` (no `$`), or None when math-verify cannot parse it."""
    gold = parse_latex(latex)
    if not gold:
        return None
    sides, ops = relation_split(latex)
    named = len(ops) == 1 and ops[0] in EQUALS_LIKE and bool(NAME.match(sides[0]))
    named = named and not _constant(parse_latex(sides[0]))  # `y = 2x + 1`, `x \\in [-2, 7]`; not `e = mc^2`
    value_latex = sides[1] if named else latex
    value = parse_latex(value_latex) if named else gold
    if not value:
        return None
    commas = "," not in value_latex and not re.search(r"\\(?:pm|mp)(?![a-zA-Z])|±|∓", value_latex)
    elements: list[list[Any]] = []
    if not ops or named:
        items = split_answers(value_latex, commas=True, bars=True, text_answers=True) or []
        if 1 < len(items) <= MAX_ELEMENTS:
            elements = [parse_latex(_named_value(item)) for item in items]
            elements = elements if all(elements) else []
    variables = frozenset(getattr(value[0], "free_symbols", None) or ())
    return Reference(latex, gold, value, [] if named else ops, elements, variables, commas)


def _named_value(item: str) -> str:
    """`x = 1` -> `1`: an element of a listed reference, without its name."""
    sides, ops = relation_split(item)
    return sides[-1] if len(ops) == 1 and ops[0] in EQUALS_LIKE and NAME.match(sides[0]) else item


def _constant(parsed: list[Any]) -> bool:
    """A parse without free symbols (a number, π, e, a set of numbers)."""
    symbols = getattr(parsed[0], "free_symbols", None) if parsed else None
    return symbols is not None and not symbols


def _names_it(side: str, parsed: list[Any], ref: Reference) -> bool:
    """`side` (parsed: `parsed`) only names the answer: a name (x, f(x), AB, \\theta), not a constant and not one
    of the value's own variables (`x = x^2 + 1` is an equation in x, not a name for x^2 + 1)."""
    return bool(NAME.match(side)) and not _constant(parsed) and not (parsed and parsed[0] in ref.variables)


def _matching_sides(part: str, ref: Reference, values: list[list[Any]]) -> set[int] | None:
    """Which of `values` every non-name side of `part` equals (None when a side is neither, a relation is not
    `=` / `\\in`, or no side is a value): `y = 2x + 1` -> {0}; `x^2 - 1 = x^2 + 1` -> None."""
    sides, ops = relation_split(part)
    if any(op not in EQUALS_LIKE for op in ops) or len(sides) > MAX_SIDES:
        return None
    hits: set[int] | None = None
    for side in sides:
        parsed = parse_latex(side)
        which = {k for k, value in enumerate(values) if _verifies(value, parsed)}
        if which:
            hits = which if hits is None else hits & which
            if not hits:
                return None
        elif not _names_it(side, parsed, ref):
            return None
    return hits


def _assignments(part: str) -> bool:
    """`x = 1, y = 2`: two or more `name = constant` items, no name twice (the coordinates of a tuple)."""
    items = split_answers(part, commas=True, bars=True) or []
    names = []
    for item in items:
        sides, ops = relation_split(item)
        if ops != ["="] or not NAME.match(sides[0]) or not _constant(parse_latex(sides[1])):
            return False
        names.append(sides[0].strip())
    return len(names) > 1 and len(set(names)) == len(names)


def _part_pays(part: str, ref: Reference) -> bool:
    """One answer against the whole reference (the module docstring's rules)."""
    sides, ops = relation_split(part)
    if ref.relations:  # `x > 3`, `x^2 + y^2 = 25`: compared whole, and no extra relation
        return len(ops) <= len(ref.relations) and same_value(ref.gold, part)
    if not ops:
        return same_value(ref.value, part)
    if "," in part and _assignments(part):  # `x = 1, y = 2` for (1, 2): one coordinate per name, compared whole
        return same_value(ref.gold, part)
    if _matching_sides(part, ref, [ref.value]):
        return True
    # one equation against `name = value`: math-verify compares equations (`2x - y + 1 = 0` for `y = 2x + 1`)
    return len(ops) == 1 and ops[0] == "=" and ref.value is not ref.gold and same_value(ref.gold, part)


def answer_pays(piece: str, ref: Reference) -> bool:
    """Every answer `piece` names is the reference's (a listed reference: its elements exactly)."""
    parts = split_answers(piece, ref.commas or bool(ref.elements), bars="|" in ref.latex, text_answers=_texty(ref))
    if not parts:
        return False
    if ref.elements and len(parts) > 1:
        covered: set[int] = set()
        for part in parts:
            hits = _matching_sides(part, ref, ref.elements)
            if not hits:
                return False
            covered |= hits
        return covered == set(range(len(ref.elements)))
    return all(_part_pays(part, ref) for part in parts)


def _texty(ref: Reference) -> bool:
    return "\\text" in ref.latex or "\\mbox" in ref.latex or "\\mathrm" in ref.latex
