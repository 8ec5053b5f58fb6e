import json
import time

import pytest

from areal_core.config import ConfigError
from areal_core.reward.math import extract_answer, gsm8k_reward
from areal_core.reward.pool import RewardPool
from tests.conftest import baseline_s, gsm8k_file, scaled

HANG_S = 600  # the hung call: far longer than any timeout here, so only the timeout can end it


def gsm8k_test_rows():
    return [json.loads(line) for line in gsm8k_file("test").read_text().splitlines() if line]


def test_every_reference_solution_scores_one_against_itself():
    rows = gsm8k_test_rows()
    assert len(rows) > 1000
    assert all(gsm8k_reward(r["answer"], r["answer"]) == 1.0 for r in rows)


def test_answers_from_other_questions_score_zero():
    rows = gsm8k_test_rows()
    finals = [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    mismatched = [(rows[i], rows[i - 1]) for i in range(len(rows)) if finals[i] != finals[i - 1]]
    assert len(mismatched) > 1000
    assert all(gsm8k_reward(other["answer"], r["answer"]) == 0.0 for r, other in mismatched)


@pytest.mark.parametrize(
    "completion, value",
    [
        ("so 3+4=7\n#### 7", 7),
        ("The answer is $1,234.", 1234),
        ("\\boxed{42}", 42),
        ("Answer: 3.50 dollars", 3.5),
        ("we get 12 then 15", 15),
        ("#### -4", -4),
    ],
)
def test_extract_answer_endings(completion, value):
    assert float(extract_answer(completion)) == value


def test_wrong_or_missing_answers_score_zero():
    assert gsm8k_reward("#### 17", "#### 18") == 0.0
    assert gsm8k_reward("no number here", "#### 18") == 0.0
    assert gsm8k_reward("#### 18.0", "#### 18") == 1.0


def sleepy(completion: str, reference: str) -> float:
    if completion == "hang":
        time.sleep(HANG_S)
    if completion == "crash":
        import os

        os._exit(3)
    if completion == "raise":
        raise RuntimeError("boom")
    return 1.0


def _fresh_pool_grades_ok() -> None:
    with RewardPool("tests.test_reward:sleepy", size=1, timeout_s=60) as pool:
        assert pool.grade([{"completion": "ok", "reference": ""}])[0].reward == 1.0


def test_pool_kills_hung_and_crashed_calls_and_keeps_serving():
    # the "ok" calls go to graders forked just before (after a kill too): the timeout, short so
    # that the hang costs little, is scaled to what a fresh grader's first call takes here now
    timeout_s = scaled(1.0, baseline_s(_fresh_pool_grades_ok))
    with RewardPool("tests.test_reward:sleepy", size=2, timeout_s=timeout_s, retries=1) as pool:
        t0 = time.time()
        jobs = [{"completion": c, "reference": ""} for c in ["ok", "hang", "crash", "raise", "ok"]]
        results = pool.grade(jobs)
        assert time.time() - t0 < HANG_S / 2  # the hang was cut by the timeout, not waited for
        assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert "timeout" in results[1].info["error"]
        assert "died" in results[2].info["error"]
        assert "boom" in results[3].info["error"]
        assert pool.stats["timeouts"] == 2  # first try and one retry
        assert [r.reward for r in pool.grade([{"completion": "ok", "reference": ""}] * 4)] == [1.0] * 4


def unbounded(completion: str) -> object:
    return {"nan": float("nan"), "inf": float("inf"), "1e39": 1e39, "-1e39": -1e39}.get(completion, 2.5)


def test_a_non_finite_reward_is_an_error_of_the_function_and_scores_zero():
    """NaN, ±inf and 1e39 (inf once stored as float32) never leave the pool as a reward."""
    with RewardPool("tests.test_reward:unbounded", size=1, timeout_s=60, retries=0) as pool:
        results = pool.grade([{"completion": c} for c in ["nan", "inf", "1e39", "-1e39", "fine"]])
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.0, 2.5]
    assert all("non-finite reward" in r.info["error"] for r in results[:4])


def test_pool_rejects_unknown_function():
    with pytest.raises(ConfigError, match="config key 'reward.function': cannot import 'tests.nope:fn'"):
        RewardPool("tests.nope:fn")
    with pytest.raises(ConfigError, match="must look like 'pkg.module:function'"):
        RewardPool("no_colon")
