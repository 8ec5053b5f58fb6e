"""Math rewards do not pay for hedging: one final answer or none, in linear time.

Every hedged or malformed answer below names the right value (18) somewhere, so a grader
that picks "the first number after the marker", or any match, would pay for it. Each scores
0 under both `gsm8k_reward` and `math_reward`. Next to them, every answer format the module
accepted before still scores 1.
"""

from __future__ import annotations

import time

import pytest

from areal_core.reward.math import extract_answer, final_answer, gsm8k_reward, math_reward

REF = "Janet has 3 ducks ... 6 * 3 = <<6*3=18>>18\n#### 18"

HEDGED = [
    "#### 18\nActually the answer is 19.",  # markers of different kinds that disagree
    "\\boxed{18}\nThe answer is 19.",
    "The answer is 1. \\boxed{2}\n#### 18\nthen 4",
    "#### 18, 3",
    "The answer is either 18 or 3.",
    "#### 18 or 19",
    "#### 3 or 18",
    "#### 18 and 3",
    "#### 18; 3",
    "#### 18 3",
    "#### 1 8",
    "#### 18 ± 1",
    "#### 18\\text{ or }3",
    "#### 18\n#### 3",
    "#### 3\nsome more work\n#### 18",
    "\\boxed{18, 3}",
    "\\boxed{3} or \\boxed{18}",
    "\\boxed{18} or \\boxed{3}",
    "\\boxed{18}\\boxed{3}",
    "first \\boxed{18}\nthen \\boxed{3}",
    "\\boxed{18} or 3",
    "\\boxed{18 \\text{ or } 3}",
    "\\boxed{18 \\lor 3}",
    "\\boxed{18 \\pm 1}",
    "\\boxed{\\{3, 18\\}}",
    "\\fbox{18} or \\fbox{3}",
    "The answer is 18 or maybe 3.",
    "The answer is 3, or possibly 18.",
    "The answer is 18. Or 3.",
    "Final answer: 18, 19, 20",
    "The final answer is 17, 18 or 19.",
    "The answer is between 17 and 19.",
    "Answer: 18 (or 3 if we count twice)",
    "The answer is $18$ or $3$.",
    "The answer is 3.\nLet me recheck.\nThe answer is 18.",
    "It is either 3 or 18.",
    "Maybe 18, maybe 3",
    "18 or 3",
    "somewhere between 17 and 19 ducks",
    # one value made a range or an estimate (review12)
    "#### 18 or more",
    "#### at least 18",
    "#### 18+",
    "#### ≈18",
    "#### ~18",
    "#### about 18",
    "#### eighteen or 18",
    "#### 18 or nineteen",
    "The answer is approximately 18.",
    "The answer is roughly 18 ducks.",
    "\\boxed{\\approx 18}",
    "\\boxed{18 \\text{ or more}}",
    "\\boxed{18} or more",
    "\\boxed{\\geq 18}",
    "So she has at least 18 eggs.",
    "It is 18 or so.",
    "She will have about $18 left.",
    "In total she earns 18+ dollars.",
]

MALFORMED = [
    "\\boxed{1800\\%}",  # a percent sign is a unit: 1800, not 18
    "#### 1800%",
    "The answer is 1800 %.",
    "#### eighteen",
    "####",
    "",
    "#### 0x12",
    "#### 18.0.0",
    "\\boxed{}",
    "The answer is .",
]

# Every format the module accepted before this change, still accepted: (completion, reference).
ACCEPTED = [
    ("#### 18", REF),
    ("#### 18.0", REF),
    ("#### 18.00", REF),
    ("#### $18", REF),
    ("####18", REF),
    ("so she pays $18 in all.\n#### $18", REF),
    ("9+5=14\n14-8=4\n#### 18", REF),
    ("#### 1,800", "#### 1800"),
    ("#### 1800", "#### 1,800"),
    ("#### €2,125.50", "#### 2125.5"),
    ("#### 50%", "#### 50"),
    ("#### .5", "#### 0.5"),
    ("#### 3/4", "#### 0.75"),
    ("####-4", "#### -4"),
    ("The answer is 18.", REF),
    ("The answer is: 18", REF),
    ("So the answer is 18 apples.", REF),
    ("Final answer: 18 dollars", REF),
    ("Answer = 18 km", REF),
    ("the answer would be 1,450,000 people", "#### 1450000"),
    ("the answer is −7", "#### -7"),
    ("the answer is -$5", "#### -5"),
    ("the answer is $-5", "#### -5"),
    ("The answer is $1,234.", "#### 1234"),
    ("\\boxed{18}", REF),
    ("$\\boxed{18}$.", REF),
    ("\\boxed{18.0}", REF),
    ("The final answer is $\\boxed{18 \\text{ dollars}}$.", REF),
    ("\\boxed{\\$1{,}200}", "#### 1200"),
    ("\\boxed{\\frac{3}{4}}", "#### 0.75"),
    ("\\boxed{\\dfrac{-1}{2}}", "#### -0.5"),
    ("first \\boxed{18} then checked: \\boxed{18}", REF),
    ("18 apples", REF),
    ("we get 12 then 18", REF),
    ("... which gives 18 in total", REF),
    ("The answer is 18. \\boxed{18}\n#### 18\nthen 4", REF),  # markers agree; junk after is ignored
    ("\\boxed{18}\n####", REF),  # a #### without a number falls through
    ("The answer is 18 = 18.", REF),  # the same value twice is one value
    ("She has 16 - 3 - 4 = 9 eggs, so she makes 9 * 2 = 18 dollars.\nThe answer is 18.", REF),
    ("16 + 2 = 18 ducks, more than the 15 she had.\n#### 18", REF),  # working may qualify, the answer not
    ("It is 18 apples.", REF),
    ("She needs at least 3 trips, so 18 minutes.", REF),  # a qualifier far from the last number
    ("About half of 36 is 18", REF),
]


@pytest.mark.parametrize("completion", HEDGED + MALFORMED)
def test_hedged_or_malformed_answers_score_zero(completion):
    assert gsm8k_reward(completion, REF) == 0.0
    assert math_reward(completion, REF) == 0.0


def test_the_suite_is_large_enough():
    assert len(HEDGED) + len(MALFORMED) >= 30 and len(HEDGED) >= 30


@pytest.mark.parametrize("completion, reference", ACCEPTED)
def test_accepted_formats_still_score_one(completion, reference):
    assert gsm8k_reward(completion, reference) == 1.0, final_answer(completion)


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("#### 18", REF),
        ("#### $18", REF),
        ("#### 1,800", "#### 1800"),
        ("The answer is 18.", REF),
        ("So the answer is 18 apples.", REF),
        ("\\boxed{18}", REF),
        ("The final answer is $\\boxed{18 \\text{ dollars}}$.", REF),
        ("\\boxed{\\frac{3}{4}}", "#### 0.75"),
        ("\\boxed{x^2 + 1}", "$x^2+1$"),
        ("\\boxed{(1, 2)}", "$(1, 2)$"),
        ("$\\frac{1}{2}$", "$0.5$"),
        ("$\\boxed{\\sqrt{4}}$", "$2$"),
        ("first \\boxed{18} then checked: \\boxed{18.0}", REF),
    ],
)
def test_math_reward_accepts_single_answers(completion, reference):
    assert math_reward(completion, reference) == 1.0


def test_hedges_are_reported_as_hedged():
    answer = final_answer("#### 18, 3")
    assert answer is not None and answer.hedged and answer.values == [18, 3] and answer.value is None
    assert extract_answer("The answer is either 18 or 3.") is None
    assert final_answer("no numbers here") is None


ADVERSARIAL = {
    "nested_boxed": lambda n: "\\boxed{" * (n // 7),
    "nested_boxed_closed": lambda n: "\\boxed{" * (n // 16) + "18" + "}" * (n // 16),
    "boxed_commas": lambda n: "\\boxed{" + "1," * (n // 2),
    "many_equal_boxes": lambda n: "\\boxed{18}" * (n // 10),
    "hashes_on_one_line": lambda n: "#### " * (n // 5),
    "hash_lines": lambda n: "#### 18\n" * (n // 8),
    "phrases": lambda n: "the answer is " * (n // 14),
    "thousands_groups": lambda n: "1" + ",111" * (n // 4) + "1",
    "digits": lambda n: "9" * n,
    "fracs": lambda n: "\\frac{1}{" * (n // 9),
    "parens_then_spaces": lambda n: "(" * (n // 2) + " " * (n // 2),
    "signs": lambda n: "- " * (n // 2),
    "spaces_after_answer": lambda n: "answer" + " " * n,
    "or_numbers": lambda n: "1 or " * (n // 5),
}


def _best_time(fn, text: str, reference: str, repeat: int = 3) -> float:
    """Least CPU time of this process over `repeat` calls (other processes on a shared machine
    do not count)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn(text, reference)
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_grading_time_is_linear(name):
    """10x the input costs about 10x the time (ratio < 20; quadratic would be ~100): extraction
    is linear, so a megabyte grades in well under a second on an idle core."""
    make = ADVERSARIAL[name]
    small, large = make(100_000), make(1_000_000)
    ratio = _best_time(gsm8k_reward, large, REF) / max(_best_time(gsm8k_reward, small, REF), 1e-4)
    assert ratio < 20, ratio
    # math_reward hands math-verify only the deciding spans, capped: the same shape
    ratio = _best_time(math_reward, large, REF) / max(_best_time(math_reward, small, REF), 1e-4)
    assert ratio < 20, ratio
