"""Reward functions as TRL's GRPOTrainer takes them (`reward_funcs`), unchanged: batched, the
completions (plain strings, or for a conversational dataset lists of messages) and the dataset's
columns as keyword arguments; a list of floats out, None where a function does not apply.

Train with (TRL's `reward_funcs` and `reward_weights`)

    reward.function=examples.coming_from.trl_rewards:accuracy_reward,examples.coming_from.trl_rewards:format_reward
    reward.weights=[1.0,0.5]
"""

from __future__ import annotations

import re
from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float | None]:
    """TRL's `accuracy_reward`: math-verify's verdict on the completion against `solution`; None
    where the solution does not parse (TRL skips those)."""
    from math_verify import parse, verify

    rewards: list[float | None] = []
    for completion, sol in zip(completions, solution):
        gold = parse(sol)
        if len(gold) == 0:
            rewards.append(None)
            continue
        rewards.append(float(verify(gold, parse(_text(completion)))))
    return rewards


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL's `think_format_reward` shape: 1.0 for `<think>…</think>` before the answer."""
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    return [1.0 if re.match(pattern, _text(c), re.DOTALL) else 0.0 for c in completions]


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Characters / 100: varies on a tiny random model, so a test sees real values flow."""
    return [len(_text(c)) / 100 for c in completions]


def kind_reward(prompts: list[Any], completions: list[Any], kind: list[str], **kwargs: Any) -> list[float | None]:
    """None (skip) for rows whose `kind` column is "skip"; else the length reward. Shows a column
    reaching the function by name and TRL's None convention."""
    return [None if k == "skip" else len(_text(c)) / 100 for c, k in zip(completions, kind)]


def kind_digits_reward(completions: list[Any], kind: list[str], **kwargs: Any) -> list[float | None]:
    """None (skip) for rows whose `kind` is "skip"; else digits / 10. With kind_reward: a row both skip."""
    return [None if k == "skip" else sum(ch.isdigit() for ch in _text(c)) / 10 for c, k in zip(completions, kind)]


def wrong_length(completions: list[Any], **kwargs: Any) -> list[float]:
    """A broken function: one reward too many."""
    return [0.0] * (len(completions) + 1)
