"""A `task.loader` plug-in (docs/data.md): records built in code, for data no table holds. A loader
may use any library, Hugging Face `datasets` included (`datasets.load_dataset(...)`)."""

from __future__ import annotations

from typing import Any


def countdown(task: Any, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): count down from n, GSM8K-style answers (the default reward reads `#### N`)."""
    records = [
        {"prompt": f"What is {n} minus 1?", "answer": f"{n} - 1 = {n - 1}\n#### {n - 1}", "meta": {"n": n}}
        for n in range(2, 200)
    ]
    held_out = records[-task.num_eval :]
    return records[: len(records) - len(held_out)][: task.num_train], held_out
