"""Run configs from YAML files plus dotted overrides, validated before any work starts.

    cfg = load_config("configs/default.yaml", ["train.lr=3e-4", "rollout.num_workers=2"])

Every key is checked: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` with a one-line message naming the key.

Every YAML text (files, override values, the run root's config.yaml) is read by
`config.base.load_yaml_text`: at most MAX_YAML_BYTES, MAX_YAML_NODES values, MAX_YAML_DEPTH
levels, no anchors or aliases, no tags but the plain ones; a Str field holds at most
MAX_STR_CHARS characters, a Text field (a prompt) MAX_TEXT_CHARS. A hostile config is one
ConfigError line, with a bounded excerpt of the value, in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from areal_core.config.base import (
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_KEY_CHARS,
    ConfigError,
    ConfigResolver,
    clip,
    excerpt,
    load_yaml_text,
    read_yaml_file,
)
from areal_core.config.hooks import import_object
from areal_core.config.run import RunConfig, resolve_python


def parse_override(text: str) -> tuple[str, Any]:
    """`"train.lr=3e-4"` -> ("train.lr", 3e-4); the value is parsed as YAML, within the bounds
    of `load_yaml_text` (so no anchors or aliases)."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"override {excerpt(text)} is {len(text)} characters, over the {MAX_YAML_BYTES} limit")
    if "=" not in text:
        raise ConfigError(f"override '{clip(text, 120)}' must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{clip(text, 120)}' has an empty key")
    parts = key.split(".")
    if len(parts) > MAX_YAML_DEPTH or max(map(len, parts)) > MAX_YAML_KEY_CHARS:
        raise ConfigError(
            f"override key '{clip(key, 120)}' is longer than {MAX_YAML_DEPTH} parts of {MAX_YAML_KEY_CHARS} characters"
        )
    value = load_yaml_text(raw, f"override '{clip(key, 120)}': value") if raw.strip() else ""
    return key, value


def _merge(base: dict[str, Any], data: Any, where: str) -> dict[str, Any]:
    """`data` laid over `base`: mappings merge key by key, anything else replaces."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{clip(where)}' must be a mapping, got {excerpt(data)}")
    out = dict(base)
    for key, value in data.items():
        old = out.get(key)
        out[key] = _merge(old, value, key) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    """`("train.lr", 1e-3)` -> `{"train": {"lr": 1e-3}}`."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _check_environment(cfg: RunConfig) -> None:
    """What the model alone cannot see: hooks import, the vLLM interpreter exists."""
    if cfg.rollout.workflow:
        import_object(cfg.rollout.workflow, key="rollout.workflow")
    if cfg.rollout.agent:
        import_object(cfg.rollout.agent, key="rollout.agent", coroutine=True)
    for key, path in (("agent.corpus", cfg.agent.corpus), ("agent.sft_examples", cfg.agent.sft_examples)):
        if path:
            import_object(path, key=key)
    srv = cfg.rollout.server
    if cfg.rollout.engine == "vllm" and not srv.url and "/" in srv.python and not resolve_python(srv.python).exists():
        raise ConfigError(
            f"config key 'rollout.server.python': no vLLM interpreter at {resolve_python(srv.python)} "
            "(run `make vllm-venv`, or set rollout.server.url)"
        )


def validate(cfg: RunConfig) -> RunConfig:
    """Every check of the model (again, after any assignments) plus the hooks and the vLLM
    interpreter; raises ConfigError naming the first bad key."""
    RunConfig.from_data(cfg.model_dump())
    _check_environment(cfg)
    return cfg


def changed(cfg: RunConfig) -> dict[str, Any]:
    """The leaves of `cfg` that differ from the model's defaults, nested:
    `changed(RunConfig(train={"eta": 0}))` -> `{"train": {"eta": 0}}`."""

    def diff(value: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, v in value.items():
            d = default.get(key)
            if isinstance(v, dict) and isinstance(d, dict):
                sub = diff(v, d)
                if sub:
                    out[key] = sub
            elif v != d:
                out[key] = v
        return out

    return diff(cfg.model_dump(), RunConfig().model_dump())


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None, typed: RunConfig | None = None
) -> RunConfig:
    """Read YAML files (if given; comma-separated paths apply in order), lay the typed config's
    changes from the model defaults (`changed(typed)`) over them, apply dotted overrides,
    validate. Raises ConfigError.

        load_config("configs/default.yaml,configs/algorithms/dapo.yaml", ["train.eta=0"])

    Precedence, lowest first: model defaults < YAML files < `typed` < overrides.
    """
    data: dict[str, Any] = {}
    for one in str(path or "").split(","):
        if not one.strip():
            continue
        data = _merge(data, read_yaml_file(Path(one.strip()), "config"), "<root>")
    if typed is not None:
        data = _merge(data, changed(typed), "<root>")
    for text in overrides or []:
        data = _merge(data, _nest(*parse_override(text)), "<root>")
    return validate(RunConfig.from_data(data))


# What every version of `to_yaml` wrote; a section added later (online, lease, ...) takes its defaults.
CORE_SECTIONS = ("name", "store", "seed", "task", "model", "sft", "rollout", "reward", "train", "eval")


def from_yaml_text(text: str | bytes, where: str = "config text") -> RunConfig:
    """Rebuild a config saved by `to_yaml` (the run root's config.yaml), read within the bounds
    of `load_yaml_text`. `to_yaml` writes every section, so a text missing one (empty, truncated,
    or hand-written) is refused rather than filled with defaults the run never had."""
    data = load_yaml_text(text, where) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: config section '<root>' must be a mapping, got {excerpt(data)}")
    cfg = validate(RunConfig.from_data(data))
    missing = [name for name in CORE_SECTIONS if name not in data]
    if missing:
        raise ConfigError(
            f"{where} lacks the section(s) {', '.join(missing)}, which every stored config holds: "
            "an empty or cut config.yaml is not the defaults"
        )
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return cfg.model_dump()


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a value seen twice twice (`load_yaml_text` refuses anchors and aliases), and quotes
    text by the reader's number rules (`ConfigResolver`): the string "1e3", a number to the reader
    though not to YAML 1.1, is written quoted."""

    yaml_implicit_resolvers = ConfigResolver.yaml_implicit_resolvers

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(cfg: RunConfig) -> str:
    return yaml.dump(to_dict(cfg), Dumper=_NoAliasDumper, sort_keys=False)


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    """`{"train.lr": 1e-3, ...}`: every leaf under its dotted key."""
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(to_dict(cfg), "")
    return out
