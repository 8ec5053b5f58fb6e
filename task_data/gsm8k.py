"""GSM8K loader: `{question, answer}` JSONL files at any local path or fsspec URI."""

from __future__ import annotations

import json
import logging
from typing import Any

import fsspec

from task_data.tables import TaskDataError

__all__ = ["TaskDataError", "final_answer", "load_split", "read_jsonl"]


def read_jsonl(uri: str) -> list[dict[str, Any]]:
    from areal_core.store import storage_options

    try:
        with fsspec.open(uri, "rt", encoding="utf-8", **storage_options(uri)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise TaskDataError(f"dataset file '{uri}' does not exist") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"dataset file '{uri}' line {i}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise TaskDataError(f"dataset file '{uri}' line {i}: needs 'question' and 'answer' fields")
        rows.append(row)
    return rows


def final_answer(solution: str) -> str:
    """The text after the last `####` of a GSM8K solution, without thousands separators."""
    if "####" not in solution:
        raise TaskDataError(f"GSM8K answer has no '####' line: {solution[-60:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_split(root: str, split: str, limit: int = 0) -> list[dict[str, Any]]:
    rows = read_jsonl(f"{root.rstrip('/')}/{split}.jsonl")
    if limit and len(rows) < limit:  # e.g. data written for another config: said, not silently trained on
        logging.getLogger("areal.task_data").warning(
            "%s/%s.jsonl has %d rows, fewer than the %d asked", root, split, len(rows), limit
        )
    if limit:
        rows = rows[:limit]
    return [
        {
            "prompt_id": f"gsm8k-{split}-{i}",
            "prompt": r["question"],
            "answer": r["answer"],
            "meta": {"final": final_answer(r["answer"])},
        }
        for i, r in enumerate(rows)
    ]
