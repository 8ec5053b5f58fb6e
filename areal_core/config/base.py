"""What every config model shares: the one error type, the strict field types, and the
conversion of a pydantic ValidationError into one line naming the dotted key.

    class Section(ConfigModel):
        lr: Float = Field(1e-3, gt=0)
    Section.from_data({"lr": "3e-4"}, prefix="train")   # YAML 1.1 gives "3e-4" as a string
    Section.from_data({"lr": -1}, prefix="train")       # ConfigError: config key 'train.lr' must be > 0, got -1
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

import yaml
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
)
from yaml.composer import Composer
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, ScalarNode

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Bounds on every YAML text a config is read from (a --config file, an --overrides value, the
# run root's config.yaml), checked while it is parsed, so that no input can take more than a
# bounded time or memory, or give more than a one-line error. Anchors and aliases (`&a`, `*a`)
# are refused outright (no config of the project uses them; an alias is how a few hundred
# bytes expand to 10^9 nodes), and so is every explicit tag but the plain ones (`!!str`, ...).
MAX_YAML_BYTES = 1 << 20  # the text itself, checked before parsing
MAX_YAML_NODES = 10_000  # scalars, sequences and mappings (a full config has ~300)
MAX_YAML_DEPTH = 32  # nesting of sequences and mappings (a config has 3)
MAX_YAML_KEY_CHARS = 128  # a mapping key
MAX_YAML_SCALAR_CHARS = 1 << 16  # any one scalar; the longest text a key takes (Text)
MAX_STR_CHARS = 4096  # a Str field: names, paths, URIs, hooks, flags
MAX_TEXT_CHARS = MAX_YAML_SCALAR_CHARS  # a Text field: prose such as task.system_prompt
MAX_EXCERPT_CHARS = 80  # a value as an error message shows it

_PLAIN_TAGS = {"!"} | {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the offending key."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def excerpt(value: Any, limit: int = MAX_EXCERPT_CHARS) -> str:
    """A bounded one-line repr of `value`, however large or deep: `excerpt("x" * 10**8)` is
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'" (80 characters at most)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # e.g. an int over Python's str-conversion digit limit
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", " ").replace("\r", " ") if "\n" in text else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = 200) -> str:
    """`text` on one line, cut to `limit` characters: for keys, paths and parser messages."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Refused(Exception):
    def __init__(self, text: str, mark: Any = None):
        super().__init__(text)
        self.text, self.mark = text, mark


class _BoundedComposer(Composer):
    """PyYAML's composer, counting the nodes and the depth as it builds them and refusing
    anchors, aliases and unknown tags before anything is expanded or constructed."""

    def __init__(self) -> None:
        super().__init__()
        self._nodes = self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused("uses an anchor or alias (&name / *name), which configs do not allow", event.start_mark)
        tag = getattr(event, "tag", None)
        if tag is not None and tag not in _PLAIN_TAGS:
            raise _Refused(f"has the tag {excerpt(tag)}, which configs do not allow", event.start_mark)
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            raise _Refused(f"has more than {MAX_YAML_NODES} values", event.start_mark)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _Refused(f"nests deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, ScalarNode):
            key = isinstance(parent, MappingNode) and index is None
            limit = MAX_YAML_KEY_CHARS if key else MAX_YAML_SCALAR_CHARS
            if len(node.value) > limit:
                what = "key" if key else "value"
                raise _Refused(f"has a {what} of {len(node.value)} characters, over {limit}", node.start_mark)
        return node

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, ScalarNode):
                if key.value in seen:
                    raise _Refused(f"repeats the key {excerpt(key.value)} (the last would win)", key.start_mark)
                seen.add(key.value)
        return node


def _config_resolver() -> type:
    """PyYAML's resolver without YAML 1.1's surprising numbers: `0123` (octal 83), `0x1F`, `1_000`
    and `12:30` (base 60, 750) stay text; an int is plain decimal and a float has a dot or an
    exponent (`3e-4` too, which YAML 1.1 leaves a string)."""
    from yaml.resolver import Resolver

    int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"

    class ConfigResolver(Resolver):
        pass

    ConfigResolver.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in pairs if tag not in (int_tag, float_tag)]
        for first, pairs in Resolver.yaml_implicit_resolvers.items()
    }
    ConfigResolver.add_implicit_resolver(int_tag, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
    number = r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
    special = r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
    ConfigResolver.add_implicit_resolver(float_tag, re.compile(f"^(?:{number}|{special})$"), list("-+0123456789."))
    return ConfigResolver


ConfigResolver = _config_resolver()


def _loader_class() -> type:
    from yaml.constructor import SafeConstructor

    Resolver = ConfigResolver  # noqa: N806 - the class the loader mixes in

    if getattr(yaml, "__with_libyaml__", False):  # libyaml's parser (C), this composer (Python)
        from yaml.cyaml import CParser

        class Loader(_BoundedComposer, CParser, SafeConstructor, Resolver):
            def __init__(self, stream: str) -> None:
                CParser.__init__(self, stream)
                _BoundedComposer.__init__(self)
                SafeConstructor.__init__(self)
                Resolver.__init__(self)

    else:  # pragma: no cover - PyYAML without libyaml
        from yaml.parser import Parser
        from yaml.reader import Reader
        from yaml.scanner import Scanner

        class Loader(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):  # type: ignore[no-redef]
            def __init__(self, stream: str) -> None:
                Reader.__init__(self, stream)
                Scanner.__init__(self)
                Parser.__init__(self)
                _BoundedComposer.__init__(self)
                SafeConstructor.__init__(self)
                Resolver.__init__(self)

    return Loader


BoundedLoader = _loader_class()


def _where(mark: Any) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if getattr(mark, "line", None) is not None else ""


def load_yaml_text(text: str | bytes, where: str) -> Any:
    """The one YAML document in `text`, read within the bounds above (BoundedLoader); None when
    empty. ConfigError, one line beginning with `where`, for anything else:

        load_yaml_text("a: &x [1]\nb: *x", "override 'a'")
        # ConfigError: override 'a' uses an anchor or alias (&name / *name), which configs do not allow (line 1, ...)
    """
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where} is {len(text)} bytes, over the {MAX_YAML_BYTES}-byte limit")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a safe constructor, bounded composer
    except _Refused as exc:
        raise ConfigError(f"{where} {exc.text}{_where(exc.mark)}") from None
    except yaml.MarkedYAMLError as exc:
        problem = exc.problem or exc.context or type(exc).__name__
        mark = exc.problem_mark or exc.context_mark
        raise ConfigError(f"{where} is not valid YAML: {clip(problem)}{_where(mark)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {clip(str(exc))}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # a constructor's (int digits, dates)
        raise ConfigError(f"{where} is not valid YAML: {clip(str(exc) or type(exc).__name__)}") from None


def read_yaml_file(path: Path, label: str, hint: str = "") -> Any:
    """The YAML document in `path` ({} when empty), read within the bounds of load_yaml_text
    (at most MAX_YAML_BYTES are read); ConfigError ("{label} file '...' does not exist{hint}",
    "... is not valid YAML: <the problem>", "... is N bytes, over ...") when it cannot be read."""
    name = clip(str(path))
    try:
        if not path.is_file():
            raise ConfigError(f"{label} file '{name}' does not exist{hint}")
        with path.open("rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{label} file '{name}' cannot be read: {clip(exc.strerror or str(exc))}") from None
    if len(data) > MAX_YAML_BYTES:
        size = path.stat().st_size
        raise ConfigError(f"{label} file '{name}' is {size} bytes, over the {MAX_YAML_BYTES}-byte limit")
    return load_yaml_text(data, f"{label} file '{name}'") or {}


class Invalid(ValueError):
    """Raised by a model validator: `key` (relative to the model that raises it, dotted for
    nested keys) and the rest of the sentence, e.g. Invalid("dual_clip", "must be 0 or > 1")."""

    def __init__(self, key: str, text: str):
        super().__init__(f"{key} {text}")
        self.key, self.text = key, text


class Unknown(Invalid):
    """Raised by a model validator for a key the model does not know: "unknown config key '<key>'<text>"."""


def _float_from_string(value: Any) -> Any:
    """YAML 1.1 reads "3e-4" (no dot) as a string: take it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _number_to_string(value: Any) -> Any:
    """A YAML int given for a text key (`name: 123`) is that text (only plain decimals are ints:
    `_config_resolver`); a bool is not, and a float is refused, since `2024.10` reads as 2024.1."""
    if isinstance(value, float):
        raise ValueError(f"must be text, got the number {value!r}: quote it to keep it as written")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


STORE_SCHEMES = ("file", "s3", "gs", "gcs", "abfs", "abfss", "az")  # stores every role process can reach


def _store_uri(value: Any) -> Any:
    """A run root: a local path or a URI of a shared store. Refused: empty (the current folder),
    a leading '~' (never expanded: a folder named '~'), a scheme no other process can reach
    (memory://) or unknown, and a URI missing a slash ('s3:/bucket' is a local folder 's3:')."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        raise ValueError("must not be empty (it would be the current folder)")
    if text.startswith("~"):
        raise ValueError(f"starts with '~', which is not expanded: give the full path, got {excerpt(value)}")
    scheme, sep, _ = text.partition("://")
    if sep and scheme.lower() not in STORE_SCHEMES:
        raise ValueError(f"has the scheme {excerpt(scheme)}: a run root is a path or one of {', '.join(STORE_SCHEMES)}")
    if not sep and re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", text):
        raise ValueError(f"looks like a URI missing a slash ({excerpt(value)}): write scheme://bucket/path")
    return value


def _temperature(value: float) -> float:
    if 0 < value < 0.01:
        raise ValueError(f"must be 0 (greedy) or at least 0.01 (below, log-probs overflow), got {value:g}")
    return value


# Strict: a bool is never an int or a float, a string never a bool or an int.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False), BeforeValidator(_float_from_string)]  # finite: no .nan, .inf
Str = Annotated[str, Strict(), BeforeValidator(_number_to_string), StringConstraints(max_length=MAX_STR_CHARS)]
Bool = Annotated[bool, Strict()]
StoreUri = Annotated[Str, AfterValidator(_store_uri)]
MAX_WAIT_S = 30 * 86400.0  # any timeout or interval: larger ones overflow time_t deadlines (lease, sleep)
Interval = Annotated[Float, Field(gt=0, le=3600)]  # seconds between polls
# A sampling temperature: 0 (greedy) or at least 0.01 (below, log-probs of 1/T-scaled logits overflow to NaN)
Temperature = Annotated[Float, Field(ge=0, le=100), AfterValidator(_temperature)]
# Text: a field that holds prose (a prompt), allowed to be longer than a Str.
Text = Annotated[str, Strict(), BeforeValidator(_number_to_string), StringConstraints(max_length=MAX_TEXT_CHARS)]

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
    dotted = clip(".".join([prefix, *loc] if prefix else loc))
    kind, ctx = err["type"], err.get("ctx") or {}
    value = excerpt(err.get("input"))
    cause = ctx.get("error")
    if kind == "extra_forbidden":
        return ConfigError(f"unknown {label} key '{dotted}'")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"{label} section '{dotted or '<root>'}' must be a mapping, got {value}")
    if kind in _TYPE_WORDS:
        return ConfigError(f"{label} key '{dotted}' must be {_TYPE_WORDS[kind]}, got {value}")
    if kind == "finite_number":
        return ConfigError(f"{label} key '{dotted}' must be a finite number, got {value}")
    if kind in _BOUNDS:
        interval = _interval(model, loc)
        rule = f"in {interval}" if interval else f"{_BOUNDS[kind]} {_number(ctx[_BOUND_KEYS[kind]])}"
        return ConfigError(f"{label} key '{dotted}' must be {rule}, got {value}")
    if kind in ("string_too_long", "too_long") and isinstance(err.get("input"), str):
        most, got = ctx.get("max_length"), len(err["input"])
        return ConfigError(f"{label} key '{dotted}' must be at most {most} characters, got {got}: {value}")
    if kind == "literal_error":
        return ConfigError(f"{label} key '{dotted}' must be one of {clip(ctx['expected'])}, got {value}")
    if isinstance(cause, Unknown):
        return ConfigError(f"unknown {label} key '{'.'.join(p for p in (dotted, cause.key) if p)}'{cause.text}")
    if isinstance(cause, Invalid):
        key = ".".join(p for p in (dotted, cause.key) if p)
        return ConfigError(f"{label} key '{key}' {clip(cause.text, 400)}")
    if isinstance(cause, ValueError):
        return ConfigError(f"{label} key '{dotted}' {clip(str(cause), 400)}")
    return ConfigError(f"{label} key '{dotted}': {clip(err['msg'], 400)}")


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
