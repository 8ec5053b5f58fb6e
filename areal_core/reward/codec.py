"""The typed encoding of values that cross the sandbox boundary (stdlib only, Python 3.8+).

Only plain data crosses, with its exact type: `None`, `bool`, `int`, `float`, `str`, `bytes`,
`complex`, `list`, `tuple`, `dict`, `set`, `frozenset`, nested at most `MAX_DEPTH` deep. A
subclass (an `int` whose `__eq__` is always true), an object with a forged `__class__`, a
function, a generator or anything else raises `Uncrossable`, naming the type. The check is
`type(v) is int`, never `isinstance`, and the host decodes into fresh built-in values, so
nothing of the program's objects (methods, dunders, identity) survives the crossing.

The wire form is JSON: `None`/`bool`/`str`/`float` as themselves (JSON floats round-trip
exactly, `NaN` and `Infinity` included), `int` as itself below 2**63 and `{"int": hex}` above,
`list` as a JSON list, and the others tagged: `{"tuple": [...]}`, `{"set": [...]}`,
`{"frozenset": [...]}`, `{"dict": [[k, v], ...]}`, `{"bytes": hex}`, `{"complex": [re, im]}`.
`decode` accepts exactly this and nothing else: it is what the host runs on bytes that come
out of the sandbox, so it never builds anything but those types (no pickle, no hooks).

This file is copied into the sandbox (`/task/_codec.py`) and loaded by the host test process
by path, so it imports nothing of the project.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 100
_BIG = 2**63
_TAGGED = ("tuple", "set", "frozenset")


class Uncrossable(TypeError):
    """A value that is not plain data, or is nested too deeply, cannot cross the boundary."""


def encode(value: Any, depth: int = 0) -> Any:
    """`value` as a JSON-ready tree with its exact type; raises Uncrossable for anything else."""
    if depth > MAX_DEPTH:
        raise Uncrossable(f"a value nested deeper than {MAX_DEPTH} levels cannot cross the boundary")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        if -_BIG < value < _BIG:
            return value
        return {"int": format(value, "x")}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    name = getattr(kind, "__qualname__", "object")
    raise Uncrossable(f"a {str(name)[:60]} cannot cross the boundary (plain data only)")


def dumps(tree: Any) -> bytes:
    """One message's bytes (compact JSON)."""
    return json.dumps(tree, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """A message's tree; raises ValueError on anything malformed."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"malformed message: {type(exc).__name__}") from None


def decode(tree: Any, depth: int = 0) -> Any:
    """The plain value of an encoded tree; raises ValueError for anything `encode` cannot produce."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(tree)
    if tree is None or kind is bool or kind is str or kind is float:
        return tree
    if kind is int:
        if not -_BIG < tree < _BIG:
            raise ValueError("a large int must be sent as {'int': hex}")
        return tree
    if kind is list:
        return [decode(v, depth + 1) for v in tree]
    if kind is not dict or len(tree) != 1:
        raise ValueError(f"malformed value {str(tree)[:60]!r}")
    tag, body = next(iter(tree.items()))
    try:
        return _decode_tagged(tag, body, depth)
    except TypeError as exc:  # an unhashable set element or dict key
        raise ValueError(f"malformed {tag}: {exc}") from None


def _decode_tagged(tag: Any, body: Any, depth: int) -> Any:
    if tag == "int" and type(body) is str:
        value = int(body, 16)
        if -_BIG < value < _BIG:
            raise ValueError("a small int must be sent as itself")
        return value
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"malformed {tag}")
    if tag == "complex":
        if len(body) != 2 or not all(type(x) is float for x in body):
            raise ValueError("malformed complex")
        return complex(body[0], body[1])
    if tag == "dict":
        if not all(type(p) is list and len(p) == 2 for p in body):
            raise ValueError("malformed dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    if tag in _TAGGED:
        items = [decode(v, depth + 1) for v in body]
        return tuple(items) if tag == "tuple" else set(items) if tag == "set" else frozenset(items)
    raise ValueError(f"unknown value type {str(tag)[:40]!r}")
