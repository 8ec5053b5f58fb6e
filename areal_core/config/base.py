"""What every config model shares: the one error type, the strict field types, and the
conversion of a pydantic ValidationError into one line naming the dotted key.

    class Section(ConfigModel):
        lr: Float = Field(1e-3, gt=0)
    Section.from_data({"lr": "3e-4"}, prefix="train")   # YAML 1.1 gives "3e-4" as a string
    Section.from_data({"lr": -1}, prefix="train")       # ConfigError: config key 'train.lr' must be > 0, got -1
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict, ValidationError

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the offending key."""


def read_yaml_file(path: Path, label: str, hint: str = "") -> Any:
    """The YAML document in `path` ({} when empty); ConfigError ("{label} file '...' does not
    exist{hint}", or "... is not valid YAML: <first line>") when it cannot be read."""
    if not path.is_file():
        raise ConfigError(f"{label} file '{path}' does not exist{hint}")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label} file '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from None


class Invalid(ValueError):
    """Raised by a model validator: `key` (relative to the model that raises it, dotted for
    nested keys) and the rest of the sentence, e.g. Invalid("dual_clip", "must be 0 or > 1")."""

    def __init__(self, key: str, text: str):
        super().__init__(f"{key} {text}")
        self.key, self.text = key, text


def _float_from_string(value: Any) -> Any:
    """YAML 1.1 reads "3e-4" (no dot) as a string: take it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _number_to_string(value: Any) -> Any:
    """A YAML number given for a text key (`name: 123`) is that text; a bool is not."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


# Strict: a bool is never an int or a float, a string never a bool or an int.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), BeforeValidator(_float_from_string)]
Str = Annotated[str, Strict(), BeforeValidator(_number_to_string)]
Bool = Annotated[bool, Strict()]

_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _interval(model: type[BaseModel] | None, loc: list[str]) -> str:
    """'[0, 1]' / '(0, 1]' when the field at `loc` has a lower and an upper bound, else ''."""
    info = None
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return ""
        info = model.model_fields[part]
        model = info.annotation
    bounds = {k: getattr(m, k) for m in (info.metadata if info else []) for k in _BOUND_KEYS.values() if hasattr(m, k)}
    lower = "[" if "ge" in bounds else "(" if "gt" in bounds else ""
    upper = "]" if "le" in bounds else ")" if "lt" in bounds else ""
    if not lower or not upper:
        return ""
    lo, hi = bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt"))
    return f"{lower}{_number(lo)}, {_number(hi)}{upper}"


def one_line(
    exc: ValidationError, label: str = "config", prefix: str = "", model: type[BaseModel] | None = None
) -> ConfigError:
    """The first error of `exc` as one line naming its dotted key (`prefix` is prepended);
    `model`, the validated class, lets a bound error give the field's whole interval."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    dotted = ".".join([prefix, *loc] if prefix else loc)
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    cause = ctx.get("error")
    if kind == "extra_forbidden":
        return ConfigError(f"unknown {label} key '{dotted}'")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"{label} section '{dotted or '<root>'}' must be a mapping, got {value!r}")
    if kind in _TYPE_WORDS:
        return ConfigError(f"{label} key '{dotted}' must be {_TYPE_WORDS[kind]}, got {value!r}")
    if kind in _BOUNDS:
        interval = _interval(model, loc)
        rule = f"in {interval}" if interval else f"{_BOUNDS[kind]} {_number(ctx[_BOUND_KEYS[kind]])}"
        return ConfigError(f"{label} key '{dotted}' must be {rule}, got {value!r}")
    if kind == "literal_error":
        return ConfigError(f"{label} key '{dotted}' must be one of {ctx['expected']}, got {value!r}")
    if isinstance(cause, Invalid):
        key = ".".join(p for p in (dotted, cause.key) if p)
        return ConfigError(f"{label} key '{key}' {cause.text}")
    if isinstance(cause, ValueError):
        return ConfigError(f"{label} key '{dotted}' {str(cause).splitlines()[0]}")
    return ConfigError(f"{label} key '{dotted}': {err['msg'].splitlines()[0]}")


class ConfigModel(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    error_label: ClassVar[str] = "config"

    @classmethod
    def from_data(cls, data: Any, prefix: str = "") -> Self:
        """Validate a mapping (from YAML); raises ConfigError naming the first bad key."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise one_line(exc, cls.error_label, prefix, cls) from None
