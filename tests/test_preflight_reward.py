"""A user's reward function is checked at prepare, before SFT and before writing anything:
it imports, it accepts the keyword arguments the reward workers pass, and it returns finite
rewards on a few training records (run/preflight_reward.py)."""

from __future__ import annotations

import math

import pytest

from areal_core.config import ConfigError
from areal_core.run import pipeline
from areal_core.store import Store
from tests.conftest import TINY

HERE = "tests.test_preflight_reward"


def wrong_signature(text: str, ref: str) -> float:  # the user's own names: never passed
    return float(text == ref)


def returns_nan(completion: str, reference: str) -> float:
    return math.nan


def always_raises(completion: str) -> float:
    raise KeyError("score_table")


def sometimes_raises(completion: str, prompt_id: str) -> float:
    if prompt_id.endswith("0"):
        raise RuntimeError("one odd record")
    return 1.0


def exact_answer(completion: str, reference: str, **_: object) -> float:
    return float(completion.strip() == reference.strip())


def positional_only(completion, /) -> float:
    return 0.0


REFUSED = {
    "wrong_signature": (
        r"wrong_signature\(text: 'str', ref: 'str'\).* requires \['text', 'ref'\].*no caller passes"
        r".*expected one of: areal: f\(completion, reference"
    ),
    "returns_nan": r"returns_nan returned a non-finite reward on 3 of 3",
    "positional_only": r"positional_only\(completion, /\).* takes \['completion'\] positionally only",
    "no_such_function": r"cannot import 'tests.test_preflight_reward:no_such_function'",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_broken_reward_function_is_refused_at_prepare_naming_it(name, tmp_path):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"preflight reward: config key 'reward.function': .*" + REFUSED[name]):
        pipeline.prepare("", [*TINY, f"store={root}", f"reward.function={HERE}:{name}"])
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize("name", ["exact_answer", "sometimes_raises", "always_raises"])
def test_a_reward_function_that_binds_and_returns_numbers_passes(name, tmp_path, caplog):
    """Raising is how some graders score 0 (the code reward on text without a program): logged, not refused."""
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", f"reward.function={HERE}:{name}"])
    assert Store(run_uri).exists("config.yaml")
    if name == "always_raises":
        assert "raised on 3 of 3 records" in caplog.text and "score_table" in caplog.text


def test_the_checked_functions_do_what_their_names_say():
    """The refusals above are the checks', not the functions' accidents."""
    assert wrong_signature("1", "1") == 1.0 and math.isnan(returns_nan("a", "b"))
    assert exact_answer(" 4 ", "4") == 1.0 and sometimes_raises("x", "p1") == 1.0
    with pytest.raises(KeyError):
        always_raises("x")


class NotAnInstance:
    def __init__(self, completion: str) -> None:
        self.completion = completion


def returns_none(completion: str) -> None:
    return None


def needs_token_offsets(completion: str, token_offsets: list) -> float:
    return 1.0


@pytest.mark.parametrize(
    "name, message",
    [
        ("NotAnInstance", r"cannot be called the way the reward workers call it, or returns no number"),
        ("returns_none", r"returns no number"),
        ("needs_token_offsets", r"requires \['token_offsets'\]"),
    ],
)
def test_a_reward_that_returns_no_number_or_wants_what_no_caller_passes_is_refused(name, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", f"reward.function={HERE}:{name}"])
