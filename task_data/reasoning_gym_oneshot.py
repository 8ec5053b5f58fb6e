"""task.name=reasoning_gym with a one-shot demonstration: `task.loader=task_data.reasoning_gym_oneshot:load`.

The records are task_data.reasoning_gym's (same questions, same splits, same meta, so the same reward, gym_reward),
each asked after one solved question of the same dataset, as an earlier chat turn (`meta.chat`: the demonstration's
question as the user, its answer `<answer>...</answer>` as the assistant, then the question). The system prompt still
goes first (task.system_prompt; reasoning-gym's default one says "When an example is provided, you should strictly
follow the format of the output/answer in that example").

Why: SmolLM2-135M-Instruct never writes the `<answer>` tag from the system prompt alone (0 of 140 greedy answers under
reasoning-gym's prompt, four rewordings of it and the instruction appended to the question; docs/benchmarks.md,
"Tasks no one here wrote"), so every answer scores 0 and GRPO has no signal; after one demonstration it tags most.

The demonstration of a dataset is its first training question (never a held-out one: the held-out questions are
apart from the training ones); that training record is asked with the same demonstration, like every other.
"""

from __future__ import annotations

from typing import Any

from task_data import reasoning_gym


def demonstrations(train: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """{dataset name: (question, answer)} of the first training record of each dataset in `train`."""
    demos: dict[str, tuple[str, str]] = {}
    for r in train:
        name = r["meta"]["reasoning_gym"]["dataset"]
        demos.setdefault(name, (r["prompt"], r["answer"]))
    return demos


def with_demo(record: dict[str, Any], demos: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """`record` asked after its dataset's demonstration (meta.chat)."""
    question, answer = demos[record["meta"]["reasoning_gym"]["dataset"]]
    chat = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": record["prompt"]},
    ]
    return {**record, "meta": {**record["meta"], "chat": chat}}


def load(task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """task_data.reasoning_gym.load's (train, eval), each record with its dataset's demonstration."""
    train, held = reasoning_gym.load(task, seed)
    demos = demonstrations(train)
    missing = {r["meta"]["reasoning_gym"]["dataset"] for r in held} - set(demos)
    if missing:  # a dataset of tiny weight may draw no training question: its held-out ones have no demonstration
        raise ValueError(f"no training question of {sorted(missing)} to demonstrate: raise task.num_train")
    return [with_demo(r, demos) for r in train], [with_demo(r, demos) for r in held]
