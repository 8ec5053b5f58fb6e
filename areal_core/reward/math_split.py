"""Reading one LaTeX answer piece (a box's contents, a math segment) as the answers it names, and an answer as the
sides of its relations: `split_answers`, `relation_split`. Pure text (no math is parsed here), at most MAX_TEXT
characters of a piece.

Parts are separated, outside braces, brackets, parentheses, `\\left..\\right` and matrix environments, by:

    always      `\\\\`, a newline, `;`, `&` (not aligning a relation), `\\quad`, `\\qquad`, `\\hspace{}`, `\\mid`,
                `\\lor`, `\\vee`, `\\land`, `\\wedge`, arrows (`\\implies`, `\\Rightarrow`, `\\iff`, `\\to`, ...),
                `\\therefore`, the rows and cells of every environment but a matrix (`cases`, `aligned`, `array`,
                also inside `\\left\\{ .. \\right.`), a `\\phantom{}` (its contents are an answer too), and `,`
                where asked (not a thousands group `1,234`)
    between two values   `\\;`, `\\:`, `\\>`, `\\ `, `~`, and any `\\text{..}` (`x^2-1 \\text{ and } x^2+1`)
    between two digits   `\\,`, `\\!`, a space (`4 \\, 3`, `4 3`; not `\\frac 1 2`)

A part that starts with a relation continues the one before (`(x+1)^2 \\\\ = x^2+2x+1`). Parts that are only words
(`\\text{cm}`) are dropped unless answers may be text; one that names a value in words (`\\text{or four}`) makes
the piece unreadable, and so do bars `|` that do not pair up (`a | b`) unless the reference has bars.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_PARTS = 6
MAX_TEXT = 2_000  # characters of a piece that is read at all (math-verify parses 500 of each answer)

_COMMAND = re.compile(r"\\(?:[a-zA-Z]+\*?|.|$)", re.DOTALL)  # a lone trailing backslash too
# environments whose contents are one value; every other environment's rows and cells are answers
_MATRIX_ENVS = frozenset("matrix pmatrix bmatrix Bmatrix vmatrix Vmatrix smallmatrix".split())
_WITH_SPEC = frozenset("array subarray tabular alignat alignat*".split())  # `\\begin{array}{cc}`: a column spec
_WITH_GROUP = frozenset(r"\hspace \hspace* \vspace \vspace*".split())  # a `{..}` argument
_PHANTOMS = frozenset(r"\phantom \hphantom \vphantom".split())
_WITH_LENGTH = frozenset(r"\hskip \vskip \kern \mkern \mskip \hglue".split())  # a length argument: `1em`, `-3mu`
_LENGTH = re.compile(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)\s*(?:em|ex|pt|mu|cm|mm|in|pc|bp|sp)?")
_ALWAYS = (
    frozenset(
        r"\\ \newline \cr \par \linebreak \quad \qquad \enspace \hfill \hspace \hspace* \hskip \mid \lor \vee \land "
        r"\wedge \implies \impliedby \iff \Rightarrow \Leftarrow \Leftrightarrow \Longrightarrow \Longleftarrow "
        r"\Longleftrightarrow \rightarrow \leftarrow \leftrightarrow \longrightarrow \longleftarrow \to \gets \mapsto "
        r"\therefore \because \And \crcr \break \allowbreak \smallskip \medskip \bigskip \models \vdash".split()
    )
    | _WITH_GROUP
    | _WITH_LENGTH
    | _PHANTOMS
)
_BETWEEN_VALUES = frozenset(r"\; \: \> \medspace \thickspace \space".split() + ["\\ "])
_THIN = frozenset(r"\, \! \thinspace \negthinspace \displaystyle \textstyle".split())
_TEXTS = frozenset(r"\text \textrm \textbf \textit \textnormal \textsf \texttt \mbox \hbox".split())
_OPENERS = frozenset(r"\{ \lbrace \langle \lvert \lVert \lceil \lfloor".split())
_CLOSERS = frozenset(r"\} \rbrace \rangle \rvert \rVert \rceil \rfloor".split())
_RELATIONS = {
    "=": "=",
    "<": "<",
    ">": ">",
    "≤": "<=",
    "≥": ">=",
    "≠": "!=",
    "≈": "~",
    "∈": "in",
    **{
        rf"\{n}": n
        for n in "le leq leqslant leqq lt ge geq geqslant geqq gt ne neq approx sim simeq cong equiv".split()
    },
    **{rf"\{n}": n for n in "propto doteq coloneqq in notin ni subset subseteq supset supseteq".split()},
}
EQUALS_LIKE = frozenset({"=", "in"})
# commands after which no value has ended / before which none starts: operators, relations, spaces, separators
_OPERATORS = (
    frozenset(
        r"\cdot \times \div \pm \mp \cup \cap \setminus \circ \ast \star \oplus \otimes \right \end \middle".split()
    )
    | frozenset(_RELATIONS)
    | _ALWAYS
    | _BETWEEN_VALUES
    | _THIN
    | _TEXTS
)
_FRACTION_ARGS = re.compile(r"(?:\\[dt]?frac|\\[dt]?binom|\\sqrt|[\^_])\s*(?:\{[^{}]*\}\s*)?\d*\s*$")
_THOUSANDS_MARK = re.compile(r"(?<=\d)(?:,\\!|\{,\}|\\,|\\!|\\ )(?=\d{3}(?!\d))")  # 10,\!000, 1\,234
_THOUSANDS_COMMA = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_EDGE_SPACES = re.compile(r"^(?:\s|~|\\[,;:!> ])+|(?:\s|~|\\[,;:!> ])+$")
_CONTINUES = re.compile(r"^\s*(?:[=<>≤≥≠≈]|\\(?:[gl]eq?|neq?|approx|equiv|sim)(?![a-zA-Z]))")
# words that name or qualify a value: a part of nothing but words may not hold one
_VALUE_WORDS = re.compile(
    r"\b(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|(?:thir|four|fif|six|seven|eigh|nine)"
    r"teen|(?:twen|thir|for|fif|six|seven|eigh|nine)ty|hundred|thousand|"
    r"million|billion|half|halves|thirds?|quarters?|twice|double|triple|negative|positive|minus|plus|opposite|"
    r"reciprocal|inverse|also|or|either|otherwise|else|alternatively|instead|maybe|perhaps|possibly|probably)\b",
    re.IGNORECASE,
)
_WORDS_ONLY = re.compile(r"^(?:\s|\\(?:text\w*|mbox|mathrm)\s*\{[A-Za-z .:']*\}|[.,:])*$")
# `\\left\{ \\begin{array} .. \\end{array} \\right.`: a system of equations, its rows answers like those of `cases`
_SYSTEM_OPEN = re.compile(r"\\left\s*(?:\\\{|\\lbrace|\.)\s*(?=\\begin\{(?!(?:p|b|B|v|V|small)?matrix\}))")
_SYSTEM_CLOSE = re.compile(r"(\\end\{(?!(?:p|b|B|v|V|small)?matrix\})[a-zA-Z*]+\})\s*\\right\s*(?:\\\}|\\rbrace|\.)")
NAME = re.compile(
    r"^\s*(?:(?:m\s*)?(?:\\angle\s*[A-Z]{1,3}|[A-Z]{2,3}|\\overline\{[A-Z]{2}\}|[A-Za-z]|\\[a-zA-Z]+)"
    r"(?:_\{?\w+\}?)?(?:'+|\^\{?-1\}?)?(?:\(\s*-?[^()+\-*/=^<>]*\))?|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])+\s*\))\s*$"
)  # x, y', x_1, f(3), f^{-1}(x), \theta, AB, \angle ABC, \overline{AB}, (x, y); not f(x^2-1)


def _group_end(text: str, start: int) -> int:
    """The index after the brace group that opens at `start` (or `start` itself if none opens there)."""
    if start >= len(text) or text[start] != "{":
        return start
    depth = 0
    for j in range(start, len(text)):
        depth += 1 if text[j] == "{" else -1 if text[j] == "}" else 0
        if depth == 0:
            return j + 1
    return len(text)


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text):
        if text[i] in " \t~":
            i += 1
            continue
        m = _COMMAND.match(text, i)
        if m and (m.group() in _THIN or m.group() in _BETWEEN_VALUES):
            i = m.end()
            continue
        return i
    return i


def _value_follows(text: str, i: int, sign: bool) -> bool:
    """A value starts at `i` (after spaces): a letter, digit, bracket, a sign if `sign`, or a command that is
    not an operator, relation or separator."""
    i = _skip_spaces(text, i)
    if i >= len(text):
        return False
    c = text[i]
    if c.isalnum() or c in "([{|." or (sign and c in "-−"):
        return True
    m = _COMMAND.match(text, i)
    return bool(m) and m.group() not in _OPERATORS and not m.group().startswith(("\\text", "\\begin"))


def _value_ended(part: str) -> bool:
    """`part` (the text of the current answer so far) ends with a complete value."""
    part = re.sub(r"(?:\s|~|\\[,;:!> ]|\\(?:thinspace|medspace|thickspace|space)(?![a-zA-Z]))+$", "", part)
    if not part:
        return False
    if part[-1].isalnum() or part[-1] in ")]}|!'%":
        tail = re.search(r"\\[a-zA-Z]+$", part)
        return not tail or tail.group() not in _OPERATORS
    return part.endswith(("\\%", "\\$", "\\}"))


def _digit_pair(text: str, i: int, part: str) -> bool:
    """A thin space or blank at `i` separates two numbers (`4 \\, 3`), not `\\frac 1 2` or `x^2 3`."""
    j = _skip_spaces(text, i)
    tail = part.rstrip()
    return j < len(text) and text[j].isdigit() and tail[-1:].isdigit() and not _FRACTION_ARGS.search(tail)


def _relation_near(text: str, i: int, part: str) -> bool:
    """`&` at `i` aligns a relation (`y &= 2x`, `y = & 2x`): one part, not two."""
    j = _skip_spaces(text, i + 1)
    after = _COMMAND.match(text, j)
    if j < len(text) and (text[j] in "=<>≤≥≠" or (after and after.group() in _RELATIONS)):
        return True
    before = part.rstrip()
    tail = re.search(r"\\[a-zA-Z]+$", before)
    return before.endswith(("=", "<", ">")) or bool(tail and tail.group() in _RELATIONS)


@dataclass
class _Scan:
    text: str
    commas: bool
    parts: list[str] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    depth: int = 0
    envs: list[tuple[str, bool]] = field(default_factory=list)  # (name, splits its rows)
    bars: int = 0

    def cut(self) -> None:
        self.parts.append(_EDGE_SPACES.sub("", "".join(self.current)))
        self.current = []

    def add(self, token: str) -> None:
        self.current.append(token)

    @property
    def part(self) -> str:
        return "".join(self.current)


def _scan_command(scan: _Scan, i: int) -> int:
    """Handle the command at `i`; return the index after it."""
    text = scan.text
    tok = _COMMAND.match(text, i).group()  # type: ignore[union-attr]
    end = i + len(tok)
    top = scan.depth == 0
    if tok in ("\\left", "\\right"):
        j = _skip_spaces(text, end)
        delim = _COMMAND.match(text, j)
        stop = delim.end() if delim else min(j + 1, len(text))
        scan.depth = scan.depth + 1 if tok == "\\left" else max(0, scan.depth - 1)
        scan.add(text[i:stop])
        return stop
    if tok in ("\\begin", "\\end"):
        stop = _group_end(text, _skip_spaces(text, end))
        env = text[end:stop].strip().strip("{}").strip()
        if tok == "\\begin":
            splits = top and env not in _MATRIX_ENVS
            scan.envs.append((env, splits))
            if splits:
                scan.cut()
                return _group_end(text, _skip_spaces(text, stop)) if env in _WITH_SPEC else stop
            else:
                scan.depth += 1
                scan.add(text[i:stop])
        else:
            splits = bool(scan.envs) and scan.envs.pop()[1]
            if splits:
                scan.cut()
            else:
                scan.depth = max(0, scan.depth - 1)
                scan.add(text[i:stop])
        return stop
    if tok in _OPENERS or tok in _CLOSERS:
        scan.depth = scan.depth + 1 if tok in _OPENERS else max(0, scan.depth - 1)
    elif top and tok in _TEXTS:
        stop = _group_end(text, _skip_spaces(text, end))
        if _value_ended(scan.part) and _value_follows(text, stop, sign=True):
            scan.cut()
            return stop
        scan.add(text[i:stop])
        return stop
    elif top and tok in _ALWAYS:
        if tok in _PHANTOMS:  # `\\phantom{x^2-1}`: a hidden value is a value
            start = _skip_spaces(text, end)
            end = _group_end(text, start)
            scan.cut()
            scan.add(text[start + 1 : end - 1])
        elif tok in _WITH_GROUP:
            end = _group_end(text, _skip_spaces(text, end))
        elif tok in _WITH_LENGTH:
            end = _LENGTH.match(text, end).end()  # type: ignore[union-attr]
        elif tok == "\\\\" and text[_skip_spaces(text, end) : _skip_spaces(text, end) + 1] == "[":
            end = text.find("]", end) + 1 or len(text)
        scan.cut()
        return end
    elif top and tok in _BETWEEN_VALUES:
        if _value_ended(scan.part) and _value_follows(text, end, sign=False):
            scan.cut()
            return end
    elif (
        top and tok in _THIN and scan.current and scan.current[-1][-1:].isdigit() and _digit_pair(text, end, scan.part)
    ):
        scan.cut()
        return end
    elif tok in ("\\vert", "\\|") and top:
        scan.bars += 1
    scan.add(tok)
    return end


def _scan_char(scan: _Scan, i: int) -> None:
    c, top = scan.text[i], scan.depth == 0
    if c in "{[(":
        scan.depth += 1
    elif c in "}])":
        scan.depth = max(0, scan.depth - 1)
    elif top and (c in "\n;" or (c == "&" and not _relation_near(scan.text, i, scan.part))):
        scan.cut()
        return
    elif top and c == "&":
        return
    elif top and c == "," and scan.commas and not _in_thousands(scan.text, i):
        scan.cut()
        return
    elif top and c == "~":
        if _value_ended(scan.part) and _value_follows(scan.text, i + 1, sign=False):
            scan.cut()
            return
    elif (
        top and c in " \t" and scan.current and scan.current[-1][-1:].isdigit() and _digit_pair(scan.text, i, scan.part)
    ):
        scan.cut()
        return
    elif top and c == "|":
        scan.bars += 1
    scan.add(c)


def _in_thousands(text: str, i: int) -> bool:
    """The comma at `i` groups thousands (`1,234`, `12,345,678`)."""
    start = max(0, i - 16)
    return any(m.start() < i < m.end() for m in _THOUSANDS_COMMA.finditer(text, start, min(len(text), i + 16)))


def split_answers(piece: str, commas: bool, bars: bool = False, text_answers: bool = False) -> list[str] | None:
    """The answers of `piece` (see the module docstring), in order; None when it cannot be read: longer than
    MAX_TEXT, more than MAX_PARTS answers, a value in words, or bars `|` that do not pair up (unless `bars`).
    `commas`: a comma separates answers; `text_answers`: a part of words is an answer, not a unit."""
    if len(piece) > MAX_TEXT:
        return None
    text = _SYSTEM_CLOSE.sub(r"\1", _SYSTEM_OPEN.sub("", _THOUSANDS_MARK.sub("", piece)))
    scan = _Scan(text, commas)
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i = _scan_command(scan, i)
        else:
            _scan_char(scan, i)
            i += 1
    scan.cut()
    if scan.bars % 2 and not bars:
        return None
    parts: list[str] = []
    for part in (p for p in scan.parts if p.strip(" .,:")):
        if parts and _CONTINUES.match(part):  # `(x+1)^2 \\ = x^2+2x+1`: one derivation over two lines
            parts[-1] = f"{parts[-1]} {part}"
        elif text_answers or not _WORDS_ONLY.match(part):
            parts.append(part)
        elif _VALUE_WORDS.search(part):  # `3 \quad \text{or four}`: a value in words
            return None
    if not parts:  # only words: the answer itself, where the reference is text
        parts = [p for p in scan.parts if p.strip(" .,:")][:1]
    return parts if len(parts) <= MAX_PARTS else None


_TWO_CHAR_RELATIONS = {"<=": "<=", ">=": ">=", "!=": "!=", "==": "=", ":=": "="}


def relation_split(latex: str) -> tuple[list[str], list[str]]:
    """(sides, relations) of `latex` at its top-level relations: `x \\le y = 3` -> (['x', 'y', '3'], ['le', '='])."""
    sides, ops, depth, start, i = [], [], 0, 0, 0
    while i < len(latex):
        m = _COMMAND.match(latex, i) if latex[i] == "\\" else None
        tok = m.group() if m else latex[i : i + 2] if latex[i : i + 2] in _TWO_CHAR_RELATIONS else latex[i]
        if tok == "\\left" or tok in _OPENERS or tok in "{[(":
            depth += 1
        elif tok == "\\right" or tok in _CLOSERS or tok in "}])":
            depth = max(0, depth - 1)
        elif depth == 0 and (tok in _RELATIONS or tok in _TWO_CHAR_RELATIONS):
            sides.append(latex[start:i].strip())
            ops.append(_RELATIONS.get(tok) or _TWO_CHAR_RELATIONS[tok])
            start = i + len(tok)
        i += len(tok)
    sides.append(latex[start:].strip())
    return sides, ops
