"""A reasoning-gym entry as strict JSON and back (`encode` / `decode`), for task_data/reasoning_gym.py's records.

Standard library only, with no import of the project: benchmarks/vs_trl.py's TRL side (a venv without the project)
loads this file by path to grade reasoning-gym samples with the entries the records carry.
"""

from __future__ import annotations

import math
from typing import Any

_TAG = "__rg__"  # marks a value JSON has no type for, in `encode`


def encode(value: Any) -> Any:
    """`value` (an entry of a reasoning-gym dataset) as strict JSON data that `decode` turns back into an equal value
    of the same types: tuples, sets, dicts with non-string keys, complex and non-finite floats are tagged, numpy
    scalars become Python numbers. TypeError for any other type."""
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):  # numpy str_
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {_TAG: "float", "v": repr(float(value))}
    if isinstance(value, complex):
        return {_TAG: "complex", "v": [encode(value.real), encode(value.imag)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {str(k): encode(v) for k, v in value.items()}
        return {_TAG: "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "v": [encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {_TAG: type(value).__name__, "v": [encode(v) for v in value]}
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        return encode(value.item())
    raise TypeError(f"a reasoning-gym entry holds a {type(value).__name__}, which the record's meta cannot carry")


def decode(value: Any) -> Any:
    """The value `encode` was given (types included)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if _TAG not in value:
        return {k: decode(v) for k, v in value.items()}
    kind, data = value[_TAG], value["v"]
    if kind == "float":
        return float(data)
    if kind == "complex":
        return complex(decode(data[0]), decode(data[1]))
    if kind == "dict":
        return {decode(k): decode(v) for k, v in data}
    items = [decode(v) for v in data]
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
