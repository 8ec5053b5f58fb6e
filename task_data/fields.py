"""Reading a table row as other frameworks write it: dotted field paths into nested structs
(verl's `reward_model.ground_truth`), chat-list prompts (OpenAI `messages`, TRL's conversational
`prompt`), and the row's other columns, which travel with the record (`meta.columns`) to the
trajectory and the reward function.
"""

from __future__ import annotations

import json
import math
from typing import Any

from task_data.tables import DatasetError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_COLUMNS_BYTES = 64 * 1024  # one record's other columns as JSON; more is an error at prepare, never a silent cut
MISSING = object()


def field_value(row: dict[str, Any], path: str) -> Any:
    """The value at `path` in `row`: a column named `path` itself, else the dotted path walked
    through nested structs (`reward_model.ground_truth`); `MISSING` when neither exists."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def has_field(row: dict[str, Any], path: str) -> bool:
    return field_value(row, path) is not MISSING


def missing_field(row: dict[str, Any], path: str, where: str, setting: str) -> DatasetError:
    """The error for a path `row` lacks, naming the deepest part that exists and its fields."""
    value: Any = row
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            break
        value, walked = value[part], [*walked, part]
    at = f" ('{'.'.join(walked)}' has no '{path.split('.')[len(walked)]}')" if walked else ""
    fields = sorted(value)[:12] if isinstance(value, dict) else type(value).__name__
    return DatasetError(f"{where}: no field '{path}'{at} (set {setting}); its fields are {fields}")


def chat_messages(value: Any, where: str, field: str) -> list[dict[str, str]] | None:
    """A chat prompt (a list of {role, content}) as plain messages, or None when `value` is not a
    list. Refused: a message that is not a {role, content} dict of strings, a role outside
    CHAT_ROLES, or a chat without a user message."""
    if not isinstance(value, list):
        return None
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(
                f"{where}: field '{field}' must be a non-empty string or a chat (a list of {{role, content}} "
                f"strings); message {i} is {_shape(m)}"
            )
        if m["role"] not in CHAT_ROLES:
            raise DatasetError(f"{where}: field '{field}' message {i} has role {m['role']!r}, not one of {CHAT_ROLES}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise DatasetError(f"{where}: field '{field}' must be a non-empty string or a chat with a user message")
    return out


def _shape(m: Any) -> str:
    return f"a dict with keys {sorted(m)[:6]}" if isinstance(m, dict) else f"a {type(m).__name__}"


def prompt_of(value: Any, where: str, field: str) -> tuple[str, list[dict[str, str]] | None]:
    """(the question text, the whole chat or None): a chat's text is its last user message."""
    chat = chat_messages(value, where, field)
    if chat is not None:
        return [m["content"] for m in chat if m["role"] == "user"][-1], chat
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: field '{field}' must be a non-empty string or a chat with a user message")
    return value, None


def other_columns(row: dict[str, Any], used: tuple[str, ...], where: str) -> dict[str, Any]:
    """Every column but the `used` ones (a dotted path takes only its leaf), as JSON values: NaN
    becomes null, bytes and dates their text. Over MAX_COLUMNS_BYTES is refused: it would ride in
    every sample row."""
    out = dict(row)
    for path in used:
        head, _, rest = path.partition(".")
        if path in out:
            out.pop(path)
        elif rest and isinstance(out.get(head), dict):
            out[head] = _without(out[head], rest)
    clean = json.loads(json.dumps(_finite(out), default=str))
    size = len(json.dumps(clean))
    if size > MAX_COLUMNS_BYTES:
        raise DatasetError(
            f"{where}: the row's other columns take {size} bytes of JSON, over {MAX_COLUMNS_BYTES}: each sample "
            "carries them; drop the large columns from the table"
        )
    return clean


def _without(value: dict[str, Any], path: str) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    out = dict(value)
    if not rest:
        out.pop(head, None)
    elif isinstance(out.get(head), dict):
        out[head] = _without(out[head], rest)
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
