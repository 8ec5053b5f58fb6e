"""Task name -> (train, eval) prompt records."""

from __future__ import annotations

from typing import Any

from datasets import arithmetic, clevr, code_tasks, gsm8k, humaneval


def load_task(task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`task` is an areal_core.config.TaskConfig."""
    if task.name == "arithmetic":
        return arithmetic.generate(
            seed, task.num_train, task.num_eval, task.ops, task.min_value, task.max_value, task.max_steps
        )
    if task.name == "gsm8k":
        return gsm8k.load_split(task.path, "train", task.num_train), gsm8k.load_split(task.path, "test", task.num_eval)
    if task.name == "code":
        return code_tasks.load(task.num_train, task.num_eval)
    if task.name == "clevr":
        return clevr.generate(
            seed, task.num_train, task.num_eval, task.questions, task.max_objects, task.describe_fraction
        )
    if task.name == "humaneval":
        return humaneval.load(task.num_train, task.num_eval)
    raise ValueError(f"unknown task {task.name!r}")
