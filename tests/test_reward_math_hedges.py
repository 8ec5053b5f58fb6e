"""Equation-shaped and multi-answer hedges (issue 54): `math_reward` pays none of them, and keeps every plain form.

An attacker who is paid for "any box that contains the answer" writes the right value next to a wrong one, joined
by whatever LaTeX offers (`\\\\`, `\\quad`, `\\mid`, `;`, `\\text{ and }`, `\\implies`, rows of `cases`, ...), or
equates it with another value (`x^2-1 = x^2+1`, `y = 3x = 2x + 1`, `\\pi = 3`). Every such completion below
names the reference's answer and scores 0; every plain spelling of it scores 1 (areal_core/reward/math_answers.py).
"""

from __future__ import annotations

import pytest

from areal_core.reward.math import math_reward
from areal_core.reward.math_split import MAX_TEXT, relation_split, split_answers

# (reference, a wrong answer of the same kind): polynomial, equation, numeric, fraction, interval, tuple, set, radical
PAIRS = [
    (r"x^2+1", r"x^2-1"),
    (r"x^2-3x+2", r"(x-1)(x+2)"),
    (r"y = 2x + 1", r"y = 2x - 1"),
    (r"3", r"4"),
    (r"\frac{3}{4}", r"\frac{4}{3}"),
    (r"\frac{\pi}{3}", r"\frac{\pi}{6}"),
    (r"[1, 3)", r"(1, 3]"),
    (r"(1, 2)", r"(2, 1)"),
    (r"\{1, 2, 3\}", r"\{1, 2\}"),
    (r"2\sqrt{3}", r"3\sqrt{2}"),
]

# what joins two answers in one box: `{}` is never a comma here (a comma is a tuple's own where the reference has one)
JOINERS = [
    r" \\ ",
    r" \\[2pt] ",
    r" \quad ",
    r" \qquad ",
    r" \mid ",
    r" ; ",
    r" \text{ and } ",
    r" \text{ or } ",
    r" \textrm{ and } ",
    r" \mbox{ and } ",
    r" \text{ } ",
    r" \text{, } ",
    " and ",
    " or ",
    r" \lor ",
    r" \vee ",
    r" \land ",
    r" \wedge ",
    r" \; ",
    r" \: ",
    r" \ ",
    r" ~ ",
    r" \hspace{1cm} ",
    "\n",
    r" \newline ",
    r" & ",
    r" \implies ",
    r" \Rightarrow ",
    r" \Longrightarrow ",
    r" \iff ",
    r" \Leftrightarrow ",
    r" \to ",
    r" \therefore ",
    r" \text{ i.e. } ",
    r" \text{ which gives } ",
]


def _joined() -> list[tuple[str, str]]:
    """Every joiner for the polynomial and equation references (the issue's), a rotating fifth of them for the
    others; both orders (the right answer first and last)."""
    cases = []
    for k, (ref, wrong) in enumerate(PAIRS):
        joiners = JOINERS if k < 3 else JOINERS[k % 5 :: 5]
        for j, joiner in enumerate(joiners):
            first, last = (ref, wrong) if j % 2 else (wrong, ref)
            cases.append((ref, rf"\boxed{{{first}{joiner}{last}}}"))
    return cases


def _environments() -> list[tuple[str, str]]:
    cases = []
    for ref, wrong in PAIRS:
        cases += [
            (ref, rf"\boxed{{\begin{{cases}} {wrong} \\ {ref} \end{{cases}}}}"),
            (ref, rf"\boxed{{\begin{{gathered}} {ref} \\ {wrong} \end{{gathered}}}}"),
            (ref, rf"\boxed{{\left\{{ \begin{{array}}{{l}} {wrong} \\ {ref} \end{{array}} \right.}}"),
        ]
    return cases


EQUATION_HEDGES = [
    # an equation between two different expressions is not the reference expression
    (r"x^2+1", r"\boxed{x^2-1 = x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1 = x^2-1}"),
    (r"x^2+1", r"\boxed{x^2+1 = 5}"),
    (r"x^2+1", r"\boxed{5 = x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1 = 0}"),
    (r"x^2+1", r"\boxed{x = x^2+1}"),  # an equation in x, not a name for the value
    (r"x^2+1", r"\boxed{y = x^2-1 = x^2+1}"),
    (r"x^2+1", r"\boxed{y = x^2+1 = x^2-1}"),
    (r"x^2+1", r"\boxed{x^2+1 = (x+1)^2}"),
    (r"x^2+1", r"\boxed{\pi = x^2+1}"),
    (r"x^2+1", r"\boxed{e = x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1 \ge x^2-1}"),
    (r"x^2+1", r"\boxed{x^2+1 > 0}"),
    (r"x^2+1", r"\boxed{x^2+1 \geq 1}"),
    (r"x^2+1", r"\boxed{x^2+1 \le x^2+2}"),
    (r"x^2+1", r"\boxed{x^2+1 \approx x^2}"),
    (r"x^2+1", r"\boxed{x^2+1 \neq x^2-1}"),
    (r"x^2+1", r"\boxed{x^2+1 \sim x^2}"),
    (r"x^2+1", r"\boxed{x^2+1 \equiv 1}"),
    (r"x^2+1", r"\boxed{x^2 \pm 1}"),
    (r"x^2+1", r"\boxed{x^2+1 \mp 2}"),
    (r"x^2+1", r"\boxed{x^2-1 | x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1 \;|\; x^2-1}"),
    (r"x^2+1", r"\boxed{x^2-1 \vert x^2+1}"),
    (r"x^2+1", r"\boxed{x^2-1 \, x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1 \, x^2-1}"),
    (r"x^2+1", r"\boxed{x^2-1 : x^2+1}"),
    (r"x^2+1", r"\boxed{x^2-1, x^2+1}"),
    (r"x^2+1", r"\boxed{x^2+1, 5}"),
    (r"x^2+1", r"\boxed{\begin{aligned} y &= x^2-1 \\ y &= x^2+1 \end{aligned}}"),
    (r"x^2+1", r"\boxed{\begin{array}{cc} x^2-1 & x^2+1 \end{array}}"),
    (r"x^2+1", r"\boxed{x^2+1 \quad (x \neq 0)}"),
    (r"x^2+1", r"\boxed{x^2+1 \text{ for } x > 1}"),
    (r"x^2+1", r"The answer is $x^2-1 = x^2+1$."),
    (r"x^2+1", r"So $\boxed{x^2-1} = x^2+1$."),
    (r"x^2+1", "Thus\n$$x^2-1 = x^2+1$$"),
    (r"x^2+1", r"#### x^2-1 = x^2+1"),
    (r"x^2-3x+2", r"\boxed{(x-1)(x-2) = 0}"),  # the equation, not the polynomial
    (r"x^2-3x+2", r"\boxed{x^2-3x+2 = (x-1)(x+2)}"),
    (r"x^2-3x+2", r"\boxed{x^2 - 3x + 2 = 0 \implies x = 1, 2}"),
    # an equation reference: two equations, chains with another value, the wrong variable
    (r"y = 2x + 1", r"\boxed{y = 3x = 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{y = 2x + 1 = 3x}"),
    (r"y = 2x + 1", r"\boxed{y = 2x+1, y = 2x-1}"),
    (r"y = 2x + 1", r"\boxed{y = 2x+1, 2x-1}"),
    (r"y = 2x + 1", r"\boxed{x = 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{y = 2x - 1 = 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{y \ge 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{y \approx 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{y = 2x \pm 1}"),
    (r"y = 2x + 1", r"\boxed{2x+1 \\ 2x-1}"),
    (r"y = 2x + 1", r"\boxed{\begin{aligned} y &= 2x - 1 \\ y &= 2x + 1 \end{aligned}}"),
    (r"y = 2x + 1", r"\boxed{y = 2x + 1 \text{ and } x = 0}"),
    (r"y = 2x + 1", r"The answer is $y = 2x - 1$ \\ $y = 2x + 1$."),
    # a number: a relation, an equation with another side, a second answer of another kind
    (r"3", r"\boxed{x + y = 3}"),
    (r"3", r"\boxed{\pi = 3}"),
    (r"3", r"\boxed{e = 3}"),
    (r"3", r"\boxed{\sqrt{x} = 3}"),
    (r"3", r"\boxed{a = 3 = b}"),
    (r"3", r"\boxed{x = 3 \implies y}"),
    (r"3", r"\boxed{3 \\ \pi}"),
    (r"3", r"\boxed{3 \quad x}"),
    (r"3", r"\boxed{x \neq 3}"),
    (r"3", r"\boxed{x \ge 3}"),
    (r"3", r"\boxed{x < 3}"),
    (r"3", r"\boxed{3 \equiv 0}"),
    (r"3", r"\boxed{x = 3 \text{ or } x = 3}"),  # a hedge word between two answers: 0 even when they agree
    (r"3", r"The answer is $x + y = 3$."),
    (r"3", r"#### x + y = 3"),
    (r"3", r"\boxed{4 \; 3}"),
    (r"3", r"\boxed{4 \, 3}"),
    (r"3", r"\boxed{4 3}"),
    (r"\frac{3}{4}", r"\boxed{x = \frac{3}{4} = 0.8}"),
    (r"\frac{3}{4}", r"\boxed{\frac{3}{4} \approx 0.8}"),
    (r"\frac{\pi}{3}", r"\boxed{\frac{\pi}{3} = 60}"),
    (r"\frac{\pi}{3}", r"\boxed{\theta = \frac{\pi}{3} \text{ or } \frac{2\pi}{3}}"),
    (r"\frac{\pi}{3}", r"\boxed{\pi + 4 3}"),
    (r"2\sqrt{3}", r"\boxed{2\sqrt{3} \approx 3.46}"),
    (r"2\sqrt{3}", r"\boxed{AB = 2\sqrt{3} = 3\sqrt{2}}"),
    (r"2\sqrt{3}", r"\boxed{\pm 2\sqrt{3}}"),
    # intervals, tuples, sets: the right one beside another, an inequality for the interval
    (r"[1, 3)", r"\boxed{x \in [1, 3) \cup (1, 3]}"),
    (r"[1, 3)", r"\boxed{[1, 3), (1, 3]}"),
    (r"[1, 3)", r"\boxed{1 \le x < 3}"),
    (r"(1, 2)", r"\boxed{(1, 2), (2, 1)}"),
    (r"(1, 2)", r"\boxed{x = 1, x = 2}"),
    (r"(1, 2)", r"\boxed{(x, y) = (1, 2) = (2, 1)}"),
    (r"\{1, 2, 3\}", r"\boxed{\{1, 2, 3\} = \{1, 2\}}"),
    (r"\{1, 2, 3\}", r"\boxed{\{1, 2, 3\}; \{1, 2\}}"),
    (r"(1, 2)", r"\boxed{(1, 2) \cup (2, 1)}"),
    (r"(1, 2)", r"\boxed{x = 1, y = 2 \\ x = 2, y = 1}"),
    (r"(1, 2)", r"\boxed{x = 1, y = 2, z = 3}"),
    (r"y = 2x + 1", r"\boxed{(y - 2x - 1)(y - 2x + 1) = 0}"),  # one equation holding both lines
    (r"y = 2x + 1", r"\boxed{y^2 = (2x+1)^2}"),
    (r"y = 2x + 1", r"\boxed{|y| = |2x + 1|}"),
    (r"y = 2x + 1", r"\boxed{y \in \{2x+1, 2x-1\}}"),
    (r"y = 2x + 1", r"\boxed{y = \{2x+1, 2x-1\}}"),
    (r"x^2+1", r"\boxed{f(x) = x^2+1, g(x) = x^2-1}"),
    (r"x^2+1", r"\boxed{f(x^2-1) = x^2+1}"),  # not a name: f at another point
    (r"[1, 3)", r"\boxed{x \in [1, 3) \text{ and } x \in (5, 6)}"),
    (r"\{1, 2, 3\}", r"\boxed{\{1, 2, 3\} \cup \{4\}}"),
    (r"x^2+1", r"The answer is $x^2+1$ \quad $x^2-1$."),
    (r"x^2+1", r"Final answer: $x^2+1 \\ x^2-1$"),
    (r"x^2+1", r"\[ x^2 + 1 \\ x^2 - 1 \]"),
    # a listed reference: a value too many, one too few, a wrong one
    (r"1, 2", r"\boxed{x \in \{1, 2, 3\}}"),
    (r"1, 2", r"\boxed{\{1, 2\}, 3}"),
    (r"1, 2", r"\boxed{1, 2, 3}"),
    (r"1, 2", r"\boxed{x = 1, x = 2, x = 3}"),
    (r"1, 2", r"\boxed{x = 1 \\ x = 2 \\ x = 3}"),
    (r"1, 2", r"\boxed{1}"),
    (r"1, 2", r"\boxed{x = 1 = 2}"),
    (r"1, 2", r"\boxed{x = 1 \quad x = 3}"),
    (r"1, 2", r"\boxed{1, 2 \\ 3}"),
]

# the polynomial beside another value in every other way LaTeX offers: hidden, stacked, unicode, spacing primitives,
# unknown environments, relations and operators that join two expressions (an attacker's list)
ATTACKS = [
    r"\boxed{x^2+1 \phantom{x^2-1}}",
    r"\boxed{x^2+1 \color{white}{x^2-1}}",
    r"\boxed{x^2+1 {\color{white} x^2-1}}",
    r"\boxed{x^2+1 \textcolor{white}{, x^2-1}}",
    r"\boxed{\underbrace{x^2+1}_{x^2-1}}",
    r"\boxed{\overset{x^2-1}{x^2+1}}",
    r"\boxed{x^2-1 \stackrel{?}{=} x^2+1}",
    r"\boxed{x^2-1 \overset{?}{=} x^2+1}",
    r"\boxed{x^2+1 \tag{x^2-1}}",
    r"\boxed{\substack{x^2+1 \\ x^2-1}}",
    r"\boxed{{x^2-1} \atop {x^2+1}}",
    r"\boxed{\cancel{x^2-1} x^2+1}",
    r"\boxed{x^2+1 \pmod{x^2-1}}",
    r"\boxed{\begin{matrix} x^2-1 \\ x^2+1 \end{matrix}}",
    r"\boxed{\begin{pmatrix} x^2+1 \end{pmatrix}}",
    r"\boxed{\{x^2+1, x^2-1\}}",
    r"\boxed{\{x^2+1\} \cup \{x^2-1\}}",
    r"\boxed{(x^2+1, x^2-1)}",
    r"\boxed{x^2+1 \mathrm{and} x^2-1}",
    r"\boxed{x^2+1 \mathbf{and} x^2-1}",
    r"\boxed{x^2-1；x^2+1}",
    r"\boxed{x^2-1，x^2+1}",
    "\\boxed{x^2-1\rx^2+1}",
    "\\boxed{x^2-1\u2028x^2+1}",
    "\\boxed{x^2-1\tx^2+1}",
    r"\boxed{x^2-1 ∣ x^2+1}",
    r"\boxed{x^2-1 ⇒ x^2+1}",
    r"\boxed{x^2+1 ≥ x^2-1}",
    r"\boxed{x^2-1 ⟺ x^2+1}",
    r"\boxed{x^2+1 ∧ x^2-1}",
    r"\boxed{\left. x^2-1 \right| x^2+1}",
    r"\boxed{x^2-1 \bigm| x^2+1}",
    r"\boxed{x^2-1 \big| x^2+1}",
    r"\boxed{x^2-1 \parallel x^2+1}",
    r"\boxed{x^2-1 \ldots x^2+1}",
    r"\boxed{x^2-1 \cdots x^2+1}",
    r"\boxed{x^2-1 \kern 1em x^2+1}",
    r"\boxed{x^2-1 \mkern18mu x^2+1}",
    r"\boxed{x^2-1 \hskip 1em x^2+1}",
    r"\boxed{x^2-1 \enspace x^2+1}",
    r"\boxed{x^2-1 \medspace x^2+1}",
    r"\boxed{x^2-1 \hphantom{x} x^2+1}",
    r"\boxed{\begin{foo} x^2-1 \\ x^2+1 \end{foo}}",
    r"\boxed{\begin{smallmatrix} x^2+1 & x^2-1 \end{smallmatrix}}",
    r"\boxed{x^2+1 \label{x^2-1}}",
    r"\boxed{x^2+1 \hbox{x^2-1}}",
    r"\boxed{x^2+1 % x^2-1}",
    "\\boxed{x^2-1 % \n x^2+1}",
    r"\boxed{x^2-1 \\ = x^2+1}",
    r"\boxed{f(x^2-1) = x^2+1}",
    r"\boxed{x^2-1 = y = x^2+1}",
    r"\boxed{x^2+1 := x^2-1}",
    r"\boxed{x^2+1 \quad \text{or four}}",
    r"\boxed{x^2+1 \text{\quad} x^2-1}",
    r"\boxed{x^2+1 \atop x^2-1}",
    r"\boxed{x^2+1 \choose x^2-1}",
    r"\boxed{x^2+1 \gets x^2-1}",
    r"\boxed{x^2+1 \leftrightarrow x^2-1}",
    r"\boxed{x^2+1 \models x^2-1}",
    r"\boxed{x^2+1 \vdash x^2-1}",
    r"\boxed{x^2+1 \oplus x^2-1}",
    r"\boxed{x^2+1 \amalg x^2-1}",
    r"\boxed{x^2+1 \sqcup x^2-1}",
    r"\boxed{x^2+1 \bot x^2-1}",
    r"\boxed{x^2+1 \top x^2-1}",
    r"\boxed{x^2+1 \nmid x^2-1}",
    r"\boxed{x^2+1 \backslash x^2-1}",
    r"\boxed{x^2+1 / x^2-1}",
    r"\boxed{x^2-1 \;/\; x^2+1}",
    r"\boxed{x^2+1 \,\text{,}\, x^2-1}",
    r"\boxed{x^2 + 1 ,\; x^2 - 1}",
    r"\boxed{x^2 + 1 \quad \square \quad x^2 - 1}",
    r"\boxed{x^2 + 1 \quad \blacksquare}",
    r"\boxed{x^2-1 \Box x^2+1}",
    r"\boxed{x^2-1\text{;}x^2+1}",
    r"\boxed{x^2+1\\x^2-1}",
    r"\boxed{x^2-1 \\\\ x^2+1}",
    r"\boxed{x^2+1 \quad\text{(}x^2-1\text{)}}",
    r"\boxed{x^2+1 \newline x^2-1}",
    r"\boxed{x^2+1 \linebreak x^2-1}",
    r"\boxed{x^2+1 \par x^2-1}",
    r"\boxed{x^2+1 \cr x^2-1}",
    r"\boxed{x^2+1 \crcr x^2-1}",
    r"\boxed{x^2+1 \hfill x^2-1}",
    r"\boxed{x^2+1 \hspace*{2em} x^2-1}",
    r"\boxed{x^2+1 \vspace{1em} x^2-1}",
    r"\boxed{x^2+1 \smallskip x^2-1}",
    r"\boxed{x^2+1 \bigskip x^2-1}",
    r"\boxed{x^2+1 \break x^2-1}",
    r"\boxed{x^2+1 \allowbreak x^2-1}",
    r"\boxed{\{x^2+1 \mid x^2-1\}}",
    r"\boxed{x^2+1 \lor x^2-1}",
    r"\boxed{\text{either } x^2+1 \text{ or } x^2-1}",
    r"\boxed{x^2+1 \pm 0}",
    r"\boxed{x^2+1 \quad x^2+1 \quad x^2-1}",
    r"\boxed{x^2+1 \hspace{1em}\text{or}\hspace{1em} x^2-1}",
    r"\boxed{x^2+1 \quad\mathrm{or}\quad x^2-1}",
    r"\boxed{x^2+1 \operatorname{and} x^2-1}",
    r"\boxed{x^2+1 \text{ and/or } x^2-1}",
    r"\boxed{x^2+1 \text{ vs } x^2-1}",
]

HEDGES = _joined() + _environments() + EQUATION_HEDGES + [(r"x^2+1", c) for c in ATTACKS]

PLAIN = [
    (r"x^2+1", r"\boxed{x^2+1}"),
    (r"x^2+1", r"\boxed{1 + x^2}"),
    (r"x^2+1", r"\boxed{x^{2} + 1}"),
    (r"x^2+1", r"\boxed{y = x^2+1}"),
    (r"x^2+1", r"\boxed{f(x) = x^2+1}"),
    (r"x^2+1", r"\boxed{p(x) = 1 + x^2}"),
    (r"x^2+1", r"\boxed{x^2+1 = 1 + x^2}"),  # one value, written twice
    (r"x^2+1", r"\boxed{\left(x^2+1\right)}"),
    (r"x^2+1", r"\boxed{x^2 \, + \, 1}"),
    (r"x^2+1", r"\boxed{x^2 \; + \; 1}"),
    (r"x^2+1", r"\boxed{x^2+1 \\ x^2+1}"),  # the same answer twice
    (r"x^2+1", r"So $f(x) = \boxed{x^2+1}$."),
    (r"x^2+1", r"The answer is $x^2 + 1$."),
    (r"x^2+1", "We expand.\n\\[ \\boxed{x^2+1} \\]"),
    (r"x^2+1", r"\boxed{\displaystyle x^2+1}"),
    (r"x^2-3x+2", r"\boxed{(x-1)(x-2)}"),
    (r"x^2-3x+2", r"\boxed{(x-2)(x-1)}"),
    (r"x^2-3x+2", r"\boxed{p(x) = (x-1)(x-2)}"),
    (r"x^2-3x+2", r"\boxed{(x-1)(x-2) = x^2 - 3x + 2}"),
    (r"x^2-3x+2", r"\boxed{x^2 - 3 x + 2}"),
    (r"y = 2x + 1", r"\boxed{y=2x+1}"),
    (r"y = 2x + 1", r"\boxed{2x+1}"),
    (r"y = 2x + 1", r"\boxed{y = 1 + 2x}"),
    (r"y = 2x + 1", r"\boxed{f(x) = 2x + 1}"),
    (r"y = 2x + 1", r"\boxed{2x + 1 = y}"),
    (r"y = 2x + 1", r"\boxed{y = \left(2x+1\right)}"),
    (r"y = 2x + 1", r"\boxed{\begin{aligned} y &= 2x + 1 \end{aligned}}"),
    (r"y = 2x + 1", r"\boxed{2x - y + 1 = 0}"),
    (r"y = 2x + 1", r"\boxed{2y = 4x + 2}"),
    (r"y = 2x + 1", r"\boxed{y = 2x + 1 = 2(x + 1) - 1}"),
    (r"x^2+2x+1", r"\boxed{(x+1)^2 \\ = x^2+2x+1}"),  # a derivation over two lines
    (r"y = 2x + 1", r"The line is $y = 2x + 1$."),
    (r"y = 2x + 1", r"$y = 2x + 1$ \\ $y = 1 + 2x$ \\ \boxed{y = 2x + 1}"),
    (r"3", r"\boxed{3}"),
    (r"3", r"\boxed{x = 3}"),
    (r"3", r"\boxed{3.0}"),
    (r"3", r"\boxed{\frac{6}{2}}"),
    (r"3", r"\boxed{x = 3, x = 3}"),  # the same value twice
    (r"3", r"\boxed{x = 3 \\ x = 3}"),
    (r"3", r"\boxed{3 = 3}"),
    (r"3", r"\boxed{3 \text{ cm}}"),
    (r"3", r"\boxed{3\,\text{cm}}"),
    (r"3", r"\boxed{n = 3}"),
    (r"3", r"The answer is $x = 3$."),
    (r"3", r"#### x = 3 dollars"),
    (r"3", r"Final answer: x = 3."),
    (r"1234", r"\boxed{1,234}"),
    (r"1234", r"\boxed{1{,}234}"),
    (r"1234", r"\boxed{1\,234}"),
    (r"1234", r"\boxed{1234}"),
    (r"10,\!000", r"\boxed{10,000}"),
    (r"10,\!000", r"\boxed{10\,000}"),
    (r"\frac{3}{4}", r"\boxed{0.75}"),
    (r"\frac{3}{4}", r"\boxed{\dfrac{3}{4}}"),
    (r"\frac{3}{4}", r"\boxed{3/4}"),
    (r"\frac{3}{4}", r"\boxed{\tfrac34}"),
    (r"\frac{3}{4}", r"\boxed{x = \frac{3}{4}}"),
    (r"\frac{3}{4}", r"\boxed{\frac{6}{8}}"),
    (r"\frac{\pi}{3}", r"\boxed{\theta = \frac{\pi}{3}}"),
    (r"\frac{\pi}{3}", r"\boxed{\dfrac{\pi}{3}}"),
    (r"\frac{\pi}{3}", r"\boxed{\pi/3}"),
    (r"2\sqrt{3}", r"\boxed{\sqrt{12}}"),
    (r"2\sqrt{3}", r"\boxed{2 \sqrt 3}"),
    (r"2\sqrt{3}", r"\boxed{2\,\sqrt{3}}"),
    (r"2\sqrt{3}", r"\boxed{AB = 2\sqrt{3}}"),
    (r"2\sqrt{3}", r"\boxed{\overline{AB} = 2\sqrt{3}}"),
    (r"[1, 3)", r"\boxed{[1,3)}"),
    (r"[1, 3)", r"\boxed{x \in [1, 3)}"),
    (r"[1, 3)", r"\boxed{\left[1, 3\right)}"),
    (r"(-\infty, 2]", r"\boxed{(-\infty,2]}"),
    (r"(-\infty, 2]", r"\boxed{x \in (-\infty, 2]}"),
    (r"(-\infty, 1) \cup (2, \infty)", r"\boxed{(-\infty,1)\cup(2,\infty)}"),
    (r"(1, 2)", r"\boxed{(1,2)}"),
    (r"(1, 2)", r"\boxed{\left(1, 2\right)}"),
    (r"(1, 2)", r"\boxed{(x, y) = (1, 2)}"),
    (r"(1, 2)", r"\boxed{x = 1, y = 2}"),
    (r"(3, -\frac{1}{2})", r"\boxed{\left(3, -\frac12\right)}"),
    (r"\{1, 2, 3\}", r"\boxed{\{3, 2, 1\}}"),
    (r"\{1, 2, 3\}", r"\boxed{\{1,2,3\}}"),
    (r"\{1, 2, 3\}", r"\boxed{S = \{1, 2, 3\}}"),
    (r"1, 2", r"\boxed{1, 2}"),
    (r"1, 2", r"\boxed{2, 1}"),
    (r"1, 2", r"\boxed{x = 1, 2}"),
    (r"1, 2", r"\boxed{x = 1, x = 2}"),
    (r"1, 2", r"\boxed{x = 2 \\ x = 1}"),
    (r"1, 2", r"\boxed{x_1 = 1, x_2 = 2}"),
    (r"1, 2", r"\boxed{1 \text{ and } 2}"),
    (r"1, 2", r"\boxed{x = 1 \quad x = 2}"),
    (r"1, 2", r"\boxed{\{1, 2\}}"),
    (r"2, -3", r"\boxed{-3, 2}"),
    (r"x = 1, 2", r"\boxed{1, 2}"),
    (r"1 \pm \sqrt{2}", r"\boxed{1 \pm \sqrt 2}"),
    (r"1 \pm \sqrt{2}", r"\boxed{1+\sqrt{2}, 1-\sqrt{2}}"),
    (r"x > 3", r"\boxed{3 < x}"),
    (r"30^\circ", r"\boxed{30^{\circ}}"),
    (r"30^\circ", r"\boxed{30}"),
    (r"75\%", r"\boxed{75\%}"),
    (r"75\%", r"\boxed{75}"),
    (r"\text{(C)}", r"\boxed{\text{(C)}}"),
    (r"\text{Monday}", r"\boxed{\text{Monday}}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}"),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}"),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\boxed{\left(\begin{array}{cc}1&2\\3&4\end{array}\right)}"),
    (r"\$18.90", r"\boxed{\$18.90}"),
]


def test_the_suite_covers_the_forms():
    refs = {ref for ref, _ in HEDGES}
    assert len(HEDGES) >= 150 and len(PLAIN) >= 100
    assert {r for r, _ in PAIRS} <= refs and len(refs) >= 11


@pytest.mark.parametrize("reference, completion", HEDGES)
def test_no_hedge_pays(reference, completion):
    for ref in (reference, f"${reference}$"):
        assert math_reward(completion, ref) == 0.0, (ref, completion)


@pytest.mark.parametrize("reference, completion", PLAIN)
def test_every_plain_form_pays(reference, completion):
    for ref in (reference, f"${reference}$"):
        assert math_reward(completion, ref) == 1.0, (ref, completion)


@pytest.mark.parametrize(
    "piece, commas, parts",
    [
        (r"y = 2x - 1 \\ y = 2x + 1", False, ["y = 2x - 1", "y = 2x + 1"]),
        (r"\begin{aligned} y &= 2x + 1 \\ &= 1 + 2x \end{aligned}", False, ["y = 2x + 1 = 1 + 2x"]),
        (r"\left\{ \begin{array}{l} a \\ b \end{array} \right.", False, ["a", "b"]),
        (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", False, [r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"]),
        (r"(1, 2), (3, 4)", True, ["(1, 2)", "(3, 4)"]),
        (r"1,234, 5", True, ["1,234", "5"]),
        (r"10\,000", True, ["10000"]),
        (r"x^2 \, + \, 1", True, [r"x^2 \, + \, 1"]),
        (r"2\,\pi", True, [r"2\,\pi"]),
        (r"4 \, 3", True, ["4", "3"]),
        (r"\frac 1 2", True, [r"\frac 1 2"]),
        (r"5 \text{ cm}", True, [r"5 \text{ cm}"]),
        (r"5 \quad \text{cm}", True, ["5"]),
        (r"a \text{ and } -b", True, ["a", "-b"]),
        (r"a \; b", True, ["a", "b"]),
        (r"a \; - b", True, [r"a \; - b"]),
        (r"|x| + |y|", True, ["|x| + |y|"]),
        (r"\phantom{x^2-1} x^2+1", True, ["x^2-1", "x^2+1"]),
    ],
)
def test_a_piece_is_split_into_its_answers(piece, commas, parts):
    assert split_answers(piece, commas) == parts


@pytest.mark.parametrize("piece", [r"a | b", r"3 \quad \text{or four}", "a \\\\ " * 7 + "a", "x" * (MAX_TEXT + 1)])
def test_a_piece_that_cannot_be_read_is_none(piece):
    assert split_answers(piece, commas=True) is None


def test_relations_are_split_at_the_top_level_only():
    assert relation_split(r"y \le 2x = 3") == (["y", "2x", "3"], ["le", "="])
    assert relation_split(r"\{x \mid x = 1\} = S") == ([r"\{x \mid x = 1\}", "S"], ["="])
    assert relation_split(r"\left(x = 1\right) := y") == ([r"\left(x = 1\right)", "y"], ["="])
