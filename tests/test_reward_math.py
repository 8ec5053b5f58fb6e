"""GSM8K answer extraction: endings, number formats, and that wrong answers score 0."""

import json
import random
from fractions import Fraction

import pytest

from areal_core.reward.math import boxed_contents, extract_answer, gsm8k_reward, math_reward, parse_number
from tests.conftest import gsm8k_file


@pytest.mark.parametrize(
    "completion, value",
    [
        # endings
        ("9+5=14\n14-8=6\n#### 6", 6),
        ("#### 1,234", 1234),
        ("####-4", -4),
        ("so she pays $18 in all.\n#### $18", 18),
        ("\\boxed{42}", 42),
        ("The final answer is $\\boxed{18 \\text{ dollars}}$.", 18),
        ("\\boxed{\\$1{,}200}", 1200),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{\\dfrac{-1}{2}}", Fraction(-1, 2)),
        ("first \\boxed{5} then checked: \\boxed{5.0}", 5),  # the same value twice is one answer
        ("The answer is 72.", 72),
        ("Final answer: 3.50 dollars", Fraction(7, 2)),
        ("Answer = 12 km", 12),
        ("the answer would be 1,450,000 people", 1450000),
        ("The answer is: -7", -7),
        ("we get 12 then 15", 15),
        # number formats
        ("#### €2,125.50", Fraction(425100, 200)),
        ("#### 50%", 50),
        ("#### .5", Fraction(1, 2)),
        ("#### 3/4", Fraction(3, 4)),
        ("the answer is −7", -7),  # unicode minus
        ("the answer is -$5", -5),
        ("the answer is $-5", -5),
        ("#### 18.00", 18),
        ("answer is 7 apples", 7),
    ],
)
def test_extracts_final_answers(completion, value):
    assert extract_answer(completion) == Fraction(value)


def test_minus_between_numbers_is_not_a_sign():
    assert extract_answer("we compute 12-5") == 5
    assert extract_answer("x=-5") == -5
    assert parse_number("(3)-2") == 3


def test_commas_that_are_not_thousands_groups_split_numbers():
    # two numbers after the phrase: a hedge, no answer (issue 12: one final answer or none)
    assert extract_answer("the answer is 3,4") is None
    assert extract_answer("#### 1 000") is None  # a space is not a thousands separator
    assert parse_number("12,5000") == 12
    assert parse_number("1,234,567.8") == Fraction("1234567.8")


def test_precedence_hash_over_boxed_over_phrase_over_last_number():
    # markers of different kinds that name different values are a hedge (issue 12)
    assert extract_answer("The answer is 1. \\boxed{2}\n#### 3\nthen 4") is None
    assert extract_answer("The answer is 3. \\boxed{3}\n#### 3\nthen 4") == 3
    assert extract_answer("The answer is 2. \\boxed{2}\nthen 4") == 2
    assert extract_answer("The answer is 1.\nthen 4 and 5") == 1
    assert extract_answer("1 then 4 and 5") == 5
    # a '####' without a number falls through to the next rule
    assert extract_answer("\\boxed{9}\n####") == 9


def test_boxed_contents_balance_braces():
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == ["\\frac{1}{2}", "x^{2}"]
    assert boxed_contents("\\boxed{unclosed") == []


@pytest.mark.parametrize(
    "completion, reference, score",
    [
        ("#### 18", "Janet sells ... #### 18", 1.0),
        ("The answer is $1,234.", "#### 1234", 1.0),
        ("#### 1234", "#### 1,234", 1.0),
        ("\\boxed{18.0}", "#### 18", 1.0),
        ("#### 17", "#### 18", 0.0),
        ("#### -18", "#### 18", 0.0),
        ("#### 180", "#### 18", 0.0),
        ("#### 1.8", "#### 18", 0.0),
        ("18 is wrong, the answer is 19", "#### 18", 0.0),
        ("", "#### 18", 0.0),
        ("no number at all", "#### 18", 0.0),
        ("#### 18", "", 0.0),
        ("#### 18", "no final answer", 0.0),
        ("####", "####", 0.0),
    ],
)
def test_gsm8k_reward_scores(completion, reference, score):
    assert gsm8k_reward(completion, reference) == score


def _rows():
    return [json.loads(line) for line in gsm8k_file("test").read_text().splitlines() if line]


def test_reformatted_gsm8k_answers_still_score_one():
    """The same final answers written the ways models write them all match the reference."""
    rows = _rows()
    finals = [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    styles = [
        lambda v: f"So the answer is {v}.",
        lambda v: f"The final answer is $\\boxed{{{v}}}$",
        lambda v: f"Answer: ${v}",
        lambda v: f"... which gives {v} in total",
        lambda v: f"#### {int(v.replace(',', '')):,}",
    ]
    scores = [gsm8k_reward(style(v), r["answer"]) for r, v in zip(rows, finals) for style in styles]
    assert len(scores) == 5 * len(rows)
    assert sum(scores) == len(scores)


def test_perturbed_gsm8k_answers_score_zero():
    """Off-by-one, sign flips and x10 of each real answer never match."""
    rng = random.Random(0)
    rows = _rows()
    checked = 0
    for r in rows:
        v = int(r["answer"].rsplit("####", 1)[1].strip().replace(",", ""))
        for wrong in {v + 1, v - 1, v * 10 + rng.randint(1, 9), -v if v else 1}:
            assert gsm8k_reward(f"The answer is {wrong}.", r["answer"]) == 0.0
            checked += 1
    assert checked > 4 * 1000


def test_math_reward_expressions():
    assert math_reward("$\\frac{1}{2}$", "$0.5$") == 1.0
    assert math_reward("$\\boxed{\\sqrt{4}}$", "$2$") == 1.0
    assert math_reward("$\\boxed{3}$", "$2$") == 0.0
    assert math_reward("The answer is \\boxed{18}", "Janet ... #### 18") == 1.0
    assert math_reward("The answer is \\boxed{17}", "Janet ... #### 18") == 0.0
