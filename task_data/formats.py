"""Prompt records from table rows (task_data/tables.py), in three formats:

    gsm8k    question / answer (a worked solution ending `#### N`); reward: gsm8k_reward
    math     problem / answer (MATH-500; bare LaTeX) or the last \\boxed{} of solution (MATH);
             reward: math_reward. The record's answer (the SFT demonstration and the reward's
             reference) is the solution with the final answer boxed last.
    dataset  the user's own table (`own_table_record`; `task.name=dataset` in configs): any table,
             task.prompt_field (default prompt) and task.reference_field (default answer);
             reward: reward.function, else math_reward

Field names may be dotted paths into nested structs (`reward_model.ground_truth`, verl's layout).
A prompt field holding a chat (a list of {role, content}: OpenAI `messages`, TRL's conversational
`prompt`) is kept whole in `meta.chat` and rendered whole through the chat template, system
message included (one ending with an assistant message is continued: a prefill); its last user
message is the record's `prompt` text. Every other column (in `dataset`, the reference's too: TRL
passes it by name) travels with the record in `meta.columns` (task_data/fields.py): stored with
each sample and passed to the reward function by name (docs/reward.md); a reference that is not a
string is kept as it is in `meta.reference` (verl's `ground_truth`). The eval split is
task.eval_split; when the data has none (or task.path is one file) and eval_split is
the default `test`, the last task.num_eval rows (at most half) are held out and not trained on,
with a warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from areal_core.reward.math import boxed_contents
from task_data.fields import MISSING, field_value, has_field, missing_field, other_columns, prompt_of
from task_data.tables import MissingSplit, TaskDataError, read_split, split_files

log = logging.getLogger("areal.task_data")

DEFAULT_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "answer"), "dataset": ("prompt", "answer")}


def _fields(task: Any, fmt: str) -> tuple[str, str]:
    prompt, reference = DEFAULT_FIELDS[fmt]
    return task.prompt_field or prompt, task.reference_field or reference


def _where(uri: str, i: int) -> str:
    return f"dataset file '{uri}' row {i}"


def _prompt(row: dict, where: str, field: str) -> dict[str, Any]:
    """The record's `prompt` text and, for a chat, `meta.chat` (the whole conversation)."""
    if not has_field(row, field):
        raise missing_field(row, field, where, "task.prompt_field")
    text, chat = prompt_of(field_value(row, field), where, field)
    return {"prompt": text, "meta": {"chat": chat} if chat else {}}


def _with_columns(record: dict[str, Any], row: dict, where: str, used: tuple[str, ...]) -> dict[str, Any]:
    columns = other_columns(row, used, where)
    if columns:
        record["meta"]["columns"] = columns
    return record


def gsm8k_record(row: dict, where: str, prompt_field: str, reference_field: str) -> dict[str, Any]:
    from task_data.gsm8k import final_answer

    if not has_field(row, reference_field):
        raise missing_field(row, reference_field, where, "task.reference_field")
    solution = str(field_value(row, reference_field))
    try:
        final = final_answer(solution)
    except TaskDataError as exc:
        raise TaskDataError(f"{where}: {exc}") from None
    record = _prompt(row, where, prompt_field)
    record.update(answer=solution, meta={**record["meta"], "final": final})
    return _with_columns(record, row, where, (prompt_field, reference_field))


def math_record(row: dict, where: str, prompt_field: str, reference_field: str) -> dict[str, Any]:
    solution = row.get("solution")
    final = field_value(row, reference_field)
    final = None if final is MISSING else final
    if final in (None, "") and isinstance(solution, str):
        boxes = boxed_contents(solution)
        final = boxes[-1] if boxes else None
    if final in (None, "") or not isinstance(final, (str, int, float)):
        raise TaskDataError(
            f"{where}: no final answer: neither a '{reference_field}' field nor a \\boxed{{}} in 'solution'"
        )
    final = str(final).strip()
    boxed = f"$\\boxed{{{final}}}$"
    answer = (
        f"{solution.rstrip()}\n\nThe answer is {boxed}." if isinstance(solution, str) and solution.strip() else boxed
    )
    record = _prompt(row, where, prompt_field)
    record.update(answer=answer, meta={**record["meta"], "final": final})
    return _with_columns(record, row, where, (prompt_field, reference_field, "solution"))


def own_table_record(row: dict, where: str, prompt_field: str, reference_field: str) -> dict[str, Any]:
    record = _prompt(row, where, prompt_field)
    if not has_field(row, reference_field):
        raise missing_field(row, reference_field, where, "task.reference_field")
    reference = field_value(row, reference_field)
    if reference is None or (isinstance(reference, float) and reference != reference) or reference == "":
        raise TaskDataError(f"{where}: field '{reference_field}' is empty (null, NaN or ''): a reference is needed")
    record["answer"] = reference if isinstance(reference, str) else json.dumps(reference, default=str)
    if not isinstance(reference, str):  # verl's compute_score gets a struct ground truth as the dict it is
        record["meta"]["reference"] = json.loads(record["answer"])
    return _with_columns(record, row, where, (prompt_field,))


BUILDERS = {"gsm8k": gsm8k_record, "math": math_record, "dataset": own_table_record}


def _records(task: Any, fmt: str, split: str, rows: list[tuple[str, int, dict]]) -> list[dict[str, Any]]:
    prompt_field, reference_field = _fields(task, fmt)
    out = []
    for n, (uri, i, row) in enumerate(rows):
        record = BUILDERS[fmt](row, _where(uri, i), prompt_field, reference_field)
        out.append({"prompt_id": f"{task.name}-{split}-{n}", **record})
    prefilled = sum(1 for r in out if (r["meta"].get("chat") or [{}])[-1].get("role") == "assistant")
    if prefilled:
        log.warning(
            "%s split: %d of %d chats in '%s' end with an assistant message, which the model continues (a "
            "prefill, as TRL reads a prompt); if it is the answer, give a prompt field without it",
            split, prefilled, len(out), prompt_field,
        )  # fmt: skip
    return out


def load(task: Any, fmt: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records of `task` (areal_core.config.TaskConfig) read as format `fmt`."""
    train_files = split_files(task.path, task.train_split)
    train_rows = read_split(task.path, task.train_split)
    if not train_rows:
        raise TaskDataError(
            f"dataset file '{', '.join(train_files)}' has no rows (the {task.train_split} split is empty)"
        )
    try:
        eval_files = split_files(task.path, task.eval_split)
    except MissingSplit:  # only a split that is not there: a damaged one is an error, never replaced
        if task.eval_split != "test":
            raise
        eval_files = None
    if eval_files is not None and eval_files != train_files:  # the same files: one table for both splits
        _same_folder(task, train_files, eval_files)
        eval_rows = read_split(task.path, task.eval_split)
        if not eval_rows:
            raise TaskDataError(
                f"dataset file '{', '.join(eval_files)}' has no rows (the {task.eval_split} split is empty)"
            )
    else:
        if len(train_rows) < 2:
            raise TaskDataError(f"dataset '{task.path}' has {len(train_rows)} rows: too few to hold any out")
        k = min(task.num_eval, len(train_rows) // 2)
        log.warning("%s has no separate test split: its last %d rows are held out, not trained on", task.path, k)
        train_rows, eval_rows = train_rows[:-k], train_rows[-k:]
    train = _limit(_records(task, fmt, "train", train_rows), task.num_train, task.path, "train")
    held = _limit(_records(task, fmt, "test", eval_rows), task.num_eval, task.path, "eval")
    return train, held


def _same_folder(task: Any, train_files: list[str], eval_files: list[str]) -> None:
    """TaskDataError when the splits come from different folders (two hub configs), except
    `save_to_disk`'s <split>/ folders."""

    def folders(files: list[str]) -> set[str]:
        return {f.rsplit("/", 1)[0] for f in files}

    tf, ef = folders(train_files), folders(eval_files)
    per_split = all(d.endswith(f"/{task.train_split}") for d in tf) and all(
        d.endswith(f"/{task.eval_split}") for d in ef
    )
    if tf != ef and not per_split:
        raise TaskDataError(
            f"dataset '{task.path}': the {task.train_split} split is in {sorted(tf)} and the {task.eval_split} split "
            f"in {sorted(ef)}: set task.path to the one folder that holds both"
        )


def _limit(records: list[dict], n: int, path: str, split: str) -> list[dict]:
    if len(records) < n and split == "train":  # data written for another config: said, not silently trained on
        log.warning("%s has %d %s rows, fewer than the %d asked", path, len(records), split, n)
    return records[:n]
