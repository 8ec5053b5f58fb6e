"""Task name -> (train, eval) prompt records: one registry, and `task.loader` for data no table holds.

A loader is `fn(task, seed) -> (train, eval)`, `task` the run's areal_core.config.TaskConfig;
each record is a dict with a non-empty string `prompt` and an `answer` (the SFT demonstration
and the reward's reference); `prompt_id` (unique) and `meta` (a dict) are optional.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from task_data import arithmetic, clevr, code_tasks, formats, humaneval, reasoning_gym
from task_data.tables import TaskDataError

Records = list[dict[str, Any]]
Loader = Callable[[Any, int], tuple[Records, Records]]

TASKS: dict[str, Loader] = {
    "arithmetic": lambda t, seed: arithmetic.generate(
        seed, t.num_train, t.num_eval, t.ops, t.min_value, t.max_value, t.max_steps
    ),
    "gsm8k": lambda t, seed: formats.load(t, "gsm8k"),
    "math": lambda t, seed: formats.load(t, "math"),
    "dataset": lambda t, seed: formats.load(t, "dataset"),
    "code": lambda t, seed: code_tasks.load(t.num_train, t.num_eval),
    "clevr": lambda t, seed: clevr.generate(
        seed, t.num_train, t.num_eval, t.questions, t.max_objects, t.describe_fraction
    ),
    "humaneval": lambda t, seed: humaneval.load(t.num_train, t.num_eval),
    "reasoning_gym": reasoning_gym.load,
}


def load_run_task(cfg: Any, seed: int | None = None) -> tuple[Records, Records]:
    """The run's (train, eval) records: its environment's (`rollout.environment`), else its task's."""
    seed = cfg.seed if seed is None else seed
    if cfg.rollout.environment:
        from areal_core.environments import load_records

        train, held_out = load_records(cfg.rollout.environment, cfg.task, seed)
        return checked(cfg.task, (train, held_out), f"rollout.environment {cfg.rollout.environment}")
    return load_task(cfg.task, seed)


def load_task(task: Any, seed: int) -> tuple[Records, Records]:
    """`task` is an areal_core.config.TaskConfig: its loader plug-in, else the registered task."""
    if task.loader:
        from areal_core.config.hooks import import_object

        fn = import_object(task.loader, key="task.loader")
        return checked(task, fn(task, seed), f"task.loader {task.loader}")
    if task.name not in TASKS:
        raise ValueError(f"unknown task {task.name!r}; registered: {sorted(TASKS)}")
    return TASKS[task.name](task, seed)


def checked(task: Any, result: Any, source: str) -> tuple[Records, Records]:
    """A loader plug-in's (train, eval), each record checked and given its prompt_id and meta;
    `source` names the loader in errors."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TaskDataError(f"{source} must return (train, eval) lists, got {type(result).__name__}")
    splits = []
    seen: set[str] = set()
    for split, rows in zip(("train", "test"), result):
        out = []
        for i, r in enumerate(list(rows)):
            where = f"{source}: {split} record {i}"
            if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not r["prompt"].strip():
                raise TaskDataError(f"{where}: needs a non-empty string 'prompt'")
            if r.get("answer") is None or r.get("answer") == "":
                raise TaskDataError(f"{where}: needs a non-empty 'answer' (the reward's reference)")
            pid = str(r.get("prompt_id") or f"{task.name}-{split}-{i}")
            if pid in seen:
                raise TaskDataError(f"{where}: prompt_id {pid!r} is used twice")
            seen.add(pid)
            meta = r.get("meta") or {}
            if not isinstance(meta, dict):
                raise TaskDataError(f"{where}: 'meta' must be a dict")
            answer = r["answer"] if isinstance(r["answer"], str) else json.dumps(r["answer"], default=str)
            out.append({**r, "prompt_id": pid, "answer": answer, "meta": meta})
        splits.append(out[: task.num_train if split == "train" else task.num_eval])
    return splits[0], splits[1]
