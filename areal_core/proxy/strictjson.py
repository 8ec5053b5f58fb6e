"""Strict JSON (RFC 8259) for everything a client sends: the request body (the guard) and the JSON
held inside a string (a tool call's `arguments`, parsed again before templating).

Python's json.loads is lenient where the proxy cannot be: it takes NaN/Infinity, integers of any
size (and then raises a ValueError about sys.set_int_max_str_digits), lone surrogates such as
"\\ud800" (which the tokenizers library later rejects with a TypeError), and nesting until the
interpreter's stack runs out (a RecursionError, in json.loads or later in a Jinja template). Every
one of those is refused here with a ValueError that says why; `NotJson` when the text is not JSON
at all, so a caller can tell malformed text from JSON that breaks a rule.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects; a request needs a handful, a JSON schema a few dozen
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class NotJson(ValueError):
    """The text is not JSON (a syntax error)."""


class TooDeep(ValueError):
    """Arrays and objects nested deeper than allowed."""


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)  # a JSON string literal, escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def nested_deeper_than(text: str | bytes, limit: int) -> bool:
    """Whether the arrays and objects of `text` (JSON or not) nest deeper than `limit`, read off its brackets
    outside string literals, before any parser recurses into them: json.loads would go as deep as the text and
    meet the interpreter's stack limit (a RecursionError deep in the stack, where even a finalizer's warning
    cannot be printed). Linear in the text; a text with at most `limit` brackets is not scanned."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for ch in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        if depth > limit:
            return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    """An int64 (both ends included); the length is checked first, so a 5,000-digit literal never
    reaches int(), which refuses over 4,300 digits with a message about interpreter settings."""
    if len(text) > 20 or not _INT64_MIN <= (value := int(text)) <= _INT64_MAX:
        raise ValueError(f"integer {text[:40]} is out of the 64-bit range")
    return value


def depth_of(value: Any, limit: int) -> int:
    """The nesting depth of arrays and objects in `value` (a scalar is 0), counted level by level
    without recursion; stops with TooDeep as soon as it passes `limit`."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level:
        depth += 1
        if depth > limit:
            raise TooDeep(f"nested more than {limit} levels deep")
        children = (c for v in level for c in (v.values() if isinstance(v, dict) else v))
        level = [c for c in children if isinstance(c, (dict, list))]
    return depth


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`text` as strict JSON, else ValueError with the reason (`NotJson` for a syntax error, `TooDeep`): UTF-8
    only; no NaN/Infinity literals; numbers that a float64 or int64 holds; strings of valid Unicode
    (no lone surrogate, which json.loads lets through); at most `max_depth` levels of nesting."""
    if nested_deeper_than(text, max_depth):
        raise TooDeep(f"nested more than {max_depth} levels deep")
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)
        depth_of(obj, max_depth)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate anywhere
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff): not valid Unicode") from None
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8") from None
    except RecursionError:
        raise TooDeep(f"nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise NotJson(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    return obj
