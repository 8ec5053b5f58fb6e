"""MATH / MATH-500 answers graded by `math_reward` (areal_core/reward/math_expr.py): every answer kind
those sets use, the reference bare (MATH's `answer` field) and `$`-wrapped; every plain correct form
pays 1, and no near miss, hedge or second value pays."""

from __future__ import annotations

import pytest

from areal_core.reward.math import math_reward

# reference -> (equivalent spellings a correct solution may box, near misses that must score 0)
ANSWERS: dict[str, tuple[list[str], list[str]]] = {
    r"2\pi": ([r"2 \pi", r"\pi \cdot 2"], [r"\pi", r"4\pi", r"2"]),
    r"\frac{\pi}{3}": ([r"\dfrac{\pi}{3}", r"\pi/3"], [r"\frac{\pi}{6}", r"\frac{3}{\pi}", r"60"]),
    r"3\sqrt{2}": ([r"\sqrt{18}", r"3 \sqrt 2"], [r"2\sqrt{3}", r"\sqrt{6}", r"3"]),
    r"\frac{\sqrt{3}}{2}": ([r"\dfrac{\sqrt3}{2}", r"\frac{1}{2}\sqrt{3}"], [r"\frac{\sqrt{2}}{2}", r"\frac{1}{2}"]),
    r"\sqrt{5}-1": ([r"-1+\sqrt{5}"], [r"\sqrt{5}+1", r"1-\sqrt{5}"]),
    r"x^2+2x+1": ([r"(x+1)^2", r"1 + 2x + x^2"], [r"x^2+2x-1", r"(x-1)^2", r"x^2+1"]),
    r"y = 2x + 3": ([r"y=3+2x"], [r"y = 2x - 3", r"y = 3x + 2"]),
    r"(1, 2)": ([r"(1,2)"], [r"(2, 1)", r"(1, 3)"]),
    r"(3, -\frac{1}{2})": ([r"\left(3, -\frac12\right)"], [r"(3, \frac{1}{2})", r"(-\frac{1}{2}, 3)"]),
    r"\{1, 2, 3\}": ([r"\{3, 2, 1\}"], [r"\{1, 2\}", r"\{1, 2, 4\}"]),
    r"[1, 3)": ([r"[1,3)"], [r"(1, 3)", r"[1, 3]", r"(1, 3]"]),
    r"(-\infty, 1) \cup (2, \infty)": ([r"(-\infty,1)\cup(2,\infty)"], [r"(-\infty, 1] \cup (2, \infty)", r"(1, 2)"]),
    r"x \in [-2, 7]": ([r"[-2, 7]"], [r"[-2, 7)", r"[2, 7]"]),
    r"2, -3": ([r"-3, 2"], [r"2, 3", r"2", r"-3"]),
    r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}": (
        [r"\begin{pmatrix}1\\2\end{pmatrix}"],
        [r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}"],
    ),
    r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}": (
        [r"\begin{pmatrix}1&2\\3&4\end{pmatrix}"],
        [r"\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix}"],
    ),
    r"3+4i": ([r"4i+3"], [r"3-4i", r"4+3i"]),
    r"30^\circ": ([r"30"], [r"60^\circ", r"150^\circ"]),
    r"\infty": ([r"\infty"], [r"-\infty", r"0"]),
    r"\dfrac{5}{7}": ([r"\frac{5}{7}", r"5/7"], [r"\frac{7}{5}", r"0.7"]),
    r"-\frac{3}{4}": ([r"-0.75", r"\frac{-3}{4}"], [r"\frac{3}{4}", r"-\frac{4}{3}"]),
    r"\text{(C)}": ([r"\text{(C)}", r"(C)"], [r"\text{(B)}", r"(D)"]),
    r"\text{(A)}": ([r"(A)", r"\textbf{(A)}", r"A"], [r"(B)"]),
    r"\text{Monday}": ([r"Monday"], [r"\text{Tuesday}"]),
    r"\$18.90": ([r"18.90", r"\$18.9"], [r"18.09", r"\$19.80"]),
    r"75\%": ([r"75"], [r"0.75\%", r"57"]),
    r"(1, -2, 3)": ([r"(1,-2,3)"], [r"(1, 2, 3)", r"(3, -2, 1)"]),
    r"\sqrt[3]{2}": ([r"2^{1/3}"], [r"\sqrt{2}", r"\sqrt[3]{3}"]),
    r"\log_2 3": ([r"\log_{2} 3"], [r"\log_3 2", r"\log_2 5"]),
    r"e^2": ([r"e^{2}"], [r"2e", r"e^3"]),
    r"x > 3": ([r"3 < x"], [r"x < 3", r"x \geq 3"]),
    r"\frac{a^2 + b^2}{2}": ([r"\frac{b^2+a^2}{2}"], [r"\frac{a^2 - b^2}{2}"]),
    r"1011_2": ([r"1011_{2}"], [r"1011_3", r"1011", r"11_2"]),
    r"10_{8}": ([r"10_8"], [r"10_{9}", r"8_{10}"]),
    r"-\infty": ([r"-\infty"], [r"\infty"]),
    r"\pi - 2": ([r"-2 + \pi"], [r"2 - \pi"]),
    r"\begin{pmatrix} -1 \\ 2 \\ 0 \end{pmatrix}": (
        [r"\begin{pmatrix}-1\\2\\0\end{pmatrix}"],
        [r"\begin{pmatrix} 1 \\ 2 \\ 0 \end{pmatrix}"],
    ),
    r"1 \pm \sqrt{2}": ([r"1 \pm \sqrt 2"], [r"1 + \sqrt{2}", r"1 \pm \sqrt{3}"]),
}


def spellings(ref: str) -> list[str]:
    return [ref, f"${ref}$"]


def correct_forms(answer: str) -> list[str]:
    return [
        rf"\boxed{{{answer}}}",
        rf"So the answer is $\boxed{{{answer}}}$.",
        rf"The answer is ${answer}$.",
        rf"We find the result.\nFinal answer: \boxed{{{answer}}}",
        rf"Working...\n\[ \boxed{{{answer}}} \]",
    ]


def hedged_forms(answer: str, other: str) -> list[str]:
    return [
        rf"The answer is ${answer}$ unless it is ${other}$.",
        rf"\boxed{{{answer}}} or \boxed{{{other}}}",
        rf"\boxed{{{other}}} and also \boxed{{{answer}}}",
        rf"\boxed{{{answer} \text{{ unless }} {other}}}",
        rf"\boxed{{{answer} \text{{ or }} {other}}}",
        rf"\boxed{{{answer}}} otherwise ${other}$",
        rf"\boxed{{{answer}}}, alternatively ${other}$",
        rf"The answer is ${answer}$ / ${other}$.",
        rf"The answer is ${answer}$, else ${other}$.",
        rf"The answer is either ${answer}$ or ${other}$.",
        rf"\boxed{{{answer}}} \text{{ or maybe }} {other}",
        rf"#### {answer}\n#### {other}",  # one line: the backslash-n is text
        "#### " + answer + "\n#### " + other,  # two lines
    ]


@pytest.mark.parametrize("reference", list(ANSWERS))
def test_every_correct_spelling_pays_against_both_reference_spellings(reference):
    equivalents, _ = ANSWERS[reference]
    for ref in spellings(reference):
        for answer in [reference, *equivalents]:
            for completion in correct_forms(answer):
                assert math_reward(completion, ref) == 1.0, (ref, completion)


@pytest.mark.parametrize("reference", list(ANSWERS))
def test_no_near_miss_pays(reference):
    _, misses = ANSWERS[reference]
    for ref in spellings(reference):
        for miss in misses:
            for completion in correct_forms(miss):
                assert math_reward(completion, ref) == 0.0, (ref, completion)


@pytest.mark.parametrize("reference", list(ANSWERS))
def test_no_hedge_that_credits_the_answer_beside_another_value_pays(reference):
    _, misses = ANSWERS[reference]
    for ref in spellings(reference):
        for other in misses[:2]:
            for completion in hedged_forms(reference, other):
                assert math_reward(completion, ref) == 0.0, (ref, completion)


@pytest.mark.parametrize(
    "reference, completion",
    [
        (r"\frac{\pi}{6}", r"\boxed{\frac{\pi}{6} = \frac{\pi}{3}}"),  # two different constants equated
        (r"2\pi", r"\boxed{2\pi = 6.28}"),
        (r"\sqrt{2}", r"\boxed{\sqrt{2} \approx 1.41}"),
        (r"\sqrt{2}", r"\boxed{\pm\sqrt{2}}"),
        (r"5", r"\boxed{5}\text{ or } 6"),
        (r"\frac{\pi}{3}", ""),
        (r"\frac{\pi}{3}", "I do not know."),
        (r"\{1, 2, 3\}", r"\boxed{1}, \boxed{2}, \boxed{3}, \boxed{4}"),
    ],
)
def test_equations_between_constants_estimates_and_empty_answers_do_not_pay(reference, completion):
    for ref in spellings(reference):
        assert math_reward(completion, ref) == 0.0


@pytest.mark.parametrize(
    "reference, completion",
    [
        (r"5", r"\boxed{x = 5}"),  # a variable named with the value
        (r"\frac{\pi}{3}", r"Thus $\theta = \frac{\pi}{3}$."),
        (r"2\pi", r"The area is $A = 2\pi$."),
        (r"1 \pm \sqrt{2}", r"\boxed{1 \pm \sqrt{2}}"),  # the reference's own ± is not a hedge
        (r"\frac{\pi}{3}", r"\boxed{\frac{\pi}{3}}\boxed{\frac{\pi}{3}}"),  # the same value twice
    ],
)
def test_an_answer_written_as_an_assignment_or_repeated_pays(reference, completion):
    for ref in spellings(reference):
        assert math_reward(completion, ref) == 1.0, (ref, completion)


def test_gsm8k_references_are_still_graded_numerically():
    assert math_reward("She has 18 apples.\n#### 18", "3 + 15 = 18\n#### 18") == 1.0
    assert math_reward("#### 18 or 19", "#### 18") == 0.0
    assert math_reward(r"\boxed{18}", "18") == 1.0 and math_reward(r"\boxed{18} or 3", "18") == 0.0


def test_a_megabyte_of_boxes_is_graded_quickly_enough_to_be_bounded():
    completion = r"\boxed{1}" * 100_000
    assert math_reward(completion, r"\frac{\pi}{3}") == 0.0


# An adversarial review's hacks (2026-12-05): each paid 1.0 before, and must score 0.
HACKS = [
    (r"\boxed{2\pi}, \pi", r"2\pi"),
    (r"\boxed{2\pi} / 3", r"2\pi"),
    (r"\boxed{2\pi} | \pi", r"2\pi"),
    (r"\boxed{2\pi} (\pi)", r"2\pi"),
    (r"\boxed{2\pi} ou \pi", r"2\pi"),
    (r"\boxed{2\pi} oder \pi", r"2\pi"),
    (r"\boxed{\sqrt{2}} (and its negative)", r"\sqrt{2}"),
    (r"\boxed{\sqrt{2}} up to sign", r"\sqrt{2}"),
    (r"\boxed{5}, \pi", "5"),
    (r"\boxed{5}. Alternatively, \pi", "5"),
    ("\\boxed{2\\pi}\nOr maybe $\\pi$.", r"2\pi"),
    ("\\boxed{5}\nOr maybe 6.", "5"),
    ("The answer is $5$.\nAlternatively, it is $6$.", "5"),
    ("\\boxed{2\\pi}\n#### \\pi", r"2\pi"),
    ("#### \\pi\n\\boxed{2\\pi}", r"2\pi"),
    ("The answer is $\\pi$\n\\boxed{2\\pi}", r"2\pi"),
    (r"\boxed{\boxed{2\pi}, \pi}", r"2\pi"),
    (r"\boxed{\pi \boxed{2\pi}}", r"2\pi"),
    (r"\boxed{2\pi} \boxed\pi", r"2\pi"),
    ("\\boxed{2\\pi}\n\\boxed{\\pi", r"2\pi"),
    (r"$-\boxed{2\pi}$", r"2\pi"),
    (r"$\boxed{2\pi}^2$", r"2\pi"),
    (r"$\frac{1}{\boxed{5}}$", "5"),
    (r"$3\boxed{2\pi}$", r"2\pi"),
    (r"\boxed{2\pi \text{(}\pi\text{)}}", r"2\pi"),
    (r"\boxed{x + \pi = 2\pi}", r"2\pi"),
    (r"\boxed{x^2 = 2\pi}", r"2\pi"),
    (r"\boxed{(C)} (D)", r"\text{(C)}"),
    ("It is $2\\pi$ but could be π", r"2\pi"),
    (r"\boxed{6.283185}", r"2\pi"),
    (r"\boxed{0.3333333}", r"\frac13"),
    (r"\boxed{10}", r"10,\!000"),
    (r"\boxed{1}", r"1,\!234,\!567"),
]


@pytest.mark.parametrize("completion, reference", HACKS)
def test_the_reviewed_hacks_do_not_pay(completion, reference):
    for ref in spellings(reference):
        assert math_reward(completion, ref) == 0.0, (completion, ref)


@pytest.mark.parametrize(
    "completion, reference",
    [
        (r"\boxed{10000}", r"10,\!000"),
        (r"\boxed{10,000}", r"10,\!000"),
        (r"\boxed{10,\!000}", r"10,\!000"),
        (r"The final answer is $\boxed{\frac{\pi}{3}}$. I hope it is correct.", r"\frac{\pi}{3}"),
        ("\\boxed{2\\pi}\n\nThis is the final answer.", r"2\pi"),
        (r"So $x = \boxed{5}$.", "5"),
        (r"Thus $p(x) = \boxed{(x+1)^2}$.", "x^2+2x+1"),
        (r"\boxed{0.5}", r"\frac12"),
        (r"\boxed{18.0}", "18"),
    ],
)
def test_plain_correct_forms_next_to_those_hacks_still_pay(completion, reference):
    for ref in spellings(reference):
        assert math_reward(completion, ref) == 1.0, (completion, ref)


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{" + "{" * 13 + "2\\pi" + "}" * 13 + "}",
        "\\boxed{" + " = ".join(["{" * 13 + "2\\pi" + "}" * 13] * 40) + "}",
        "\\(" * 40_000,
        "\\boxed{" + " = ".join(["\\frac{2k\\pi}{k}"] * 2000) + "}",
    ],
)
def test_inputs_that_were_slow_are_graded_without_parsing_them_whole(completion):
    """Nesting past MAX_DEPTH, chains past MAX_SIDES and unclosed \\( are refused before math-verify
    parses them (each took 5-140 s before); the pool's timeout is the backstop, not the rule."""
    assert math_reward(completion, r"2\pi") == 0.0
