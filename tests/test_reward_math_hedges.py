"""Equation-shaped and multi-answer hedges (issue 54): `math_reward` pays none of them, and keeps every plain form.

An attacker who is paid for "any box that contains the answer" writes the right value next to a wrong one, joined
by whatever LaTeX offers (`\\\\`, `\\quad`, `\\mid`, `;`, `\\text{ and }`, `\\implies`, rows of `cases`, ...), or
equates it with another value (`x^2-1 = x^2+1`, `y = 3x = 2x + 1`, `\\pi = 3`). Every such completion below
names the reference's answer and scores 0; every plain spelling of it scores 1 (areal_core/reward/math_answers.py).
"""

from __future__ import annotations

import pytest

from areal_core.reward.math import math_reward

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
    # a listed reference: a value too many, one too few, a wrong one
    (r"1, 2", r"\boxed{1, 2, 3}"),
    (r"1, 2", r"\boxed{x = 1, x = 2, x = 3}"),
    (r"1, 2", r"\boxed{x = 1 \\ x = 2 \\ x = 3}"),
    (r"1, 2", r"\boxed{1}"),
    (r"1, 2", r"\boxed{x = 1 = 2}"),
    (r"1, 2", r"\boxed{x = 1 \quad x = 3}"),
    (r"1, 2", r"\boxed{1, 2 \\ 3}"),
]

HEDGES = _joined() + _environments() + EQUATION_HEDGES

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
