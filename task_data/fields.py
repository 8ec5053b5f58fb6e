"""Reading a table row as other frameworks write it: dotted field paths into nested structs
(verl's `reward_model.ground_truth`), chat-list prompts (OpenAI `messages`, TRL's conversational
`prompt`), and the row's other columns, which travel with the record (`meta.columns`) to the
trajectory and the reward function.
"""

from __future__ import annotations

import json
import math
from typing import Any

from task_data.tables import TaskDataError

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


def missing_field(row: dict[str, Any], path: str, where: str, setting: str) -> TaskDataError:
    """The error for a path `row` lacks, naming the deepest part that exists and its fields."""
    value: Any = row
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            break
        value, walked = value[part], [*walked, part]
    at = f" ('{'.'.join(walked)}' has no '{path.split('.')[len(walked)]}')" if walked else ""
    fields = sorted(value)[:12] if isinstance(value, dict) else type(value).__name__
    return TaskDataError(f"{where}: no field '{path}'{at} (set {setting}); its fields are {fields}")


def chat_messages(value: Any, where: str, field: str) -> list[dict[str, str]] | None:
    """A chat prompt (a list of {role, content}) as plain messages, or None when `value` is not a
    list. A content given as OpenAI text parts (`[{"type": "text", "text": ...}]`) is their text
    joined, as the proxy reads it. Refused: a message that is not a {role, content} dict, a content
    that is neither a string nor text parts (an image part, a tool call's null content), a role
    outside CHAT_ROLES, or a chat without a user message."""
    if not isinstance(value, list):
        return None
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise TaskDataError(
                f"{where}: field '{field}' must be a non-empty string or a chat (a list of {{role, content}} "
                f"strings); message {i} is {_shape(m)}"
            )
        if m["role"] not in CHAT_ROLES:
            raise TaskDataError(f"{where}: field '{field}' message {i} has role {m['role']!r}, not one of {CHAT_ROLES}")
        out.append({"role": m["role"], "content": _content_text(m["content"], f"{where}: field '{field}' message {i}")})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise TaskDataError(f"{where}: field '{field}' must be a non-empty string or a chat with a user message")
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        bad = next((p for p, t in zip(content, texts) if not isinstance(t, str)), None)
        if bad is None:
            return "".join(texts)  # type: ignore[arg-type]
        kind = bad.get("type") if isinstance(bad, dict) else type(bad).__name__
        raise TaskDataError(
            f"{where} has a content part of type {kind!r}: only text parts ({{type: text, text}}) are read "
            "into a prompt (images: a vision-language task, docs/vlm.md)"
        )
    shown = "an empty list" if isinstance(content, list) else f"of type {type(content).__name__}"
    raise TaskDataError(
        f"{where} has content {shown}, not a string or text parts (a tool call in a prompt is not rendered)"
    )


def _shape(m: Any) -> str:
    return f"a dict with keys {sorted(m)[:6]}" if isinstance(m, dict) else f"a {type(m).__name__}"


def prompt_of(value: Any, where: str, field: str) -> tuple[str, list[dict[str, str]] | None]:
    """(the question text, the whole chat or None): a chat's text is its last user message."""
    chat = chat_messages(value, where, field)
    if chat is not None:
        return [m["content"] for m in chat if m["role"] == "user"][-1], chat
    if not isinstance(value, str) or not value.strip():
        raise TaskDataError(f"{where}: field '{field}' must be a non-empty string or a chat with a user message")
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
    try:
        clean = json.loads(json.dumps(_finite(out), default=str))
    except RecursionError:  # JSON the table reader took, nested past what the interpreter can walk
        raise TaskDataError(f"{where}: the row's other columns are nested too deeply") from None
    size = len(json.dumps(clean))
    if size > MAX_COLUMNS_BYTES:
        raise TaskDataError(
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
