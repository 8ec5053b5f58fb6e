"""Typed run configuration: YAML files plus dotted overrides, validated before any work starts.

    cfg = load_config("configs/default.yaml", ["train.lr=3e-4", "rollout.num_workers=2"])

Every key is checked: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` with a one-line message naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_core.train.algorithm import AlgorithmConfig


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the offending key."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k
    path: str = ""  # gsm8k: folder or URI holding train.jsonl / test.jsonl
    num_train: int = 20000
    num_eval: int = 500
    min_value: int = 10
    max_value: int = 99
    max_steps: int = 1  # arithmetic: number of worked steps (1..3)
    ops: str = "+-"


@dataclass
class ModelConfig:
    path: str = ""  # an HF checkpoint folder/URI; empty: the tiny model built from this config
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    vocab_size: int = 384  # tokenizer BPE size for the embedded task


@dataclass
class SFTConfig:
    enabled: bool = True
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant (after warmup)
    # Share of multi-step problems kept in the SFT set (1.0 keeps all). The default job
    # under-represents them, as demonstrations often do, and RL with the verifier closes the gap.
    multi_step_fraction: float = 1.0


@dataclass
class ServerConfig:
    """The inference server of a remote engine (rollout.engine vllm | sglang); docs/vllm.md."""

    url: str = ""  # a running server; empty: each vLLM rollout worker starts its own (sglang needs a URL)
    python: str = ".venv-vllm/bin/python"  # the vLLM server's interpreter (relative: from the project root)
    interrupt: str = "keep"  # vLLM weight update: keep (pause, keep requests, re-prefill) | abort (re-submit)
    kv_cache_mb: int = 256
    max_num_seqs: int = 256
    threads: int = 1
    dtype: str = "float32"
    startup_timeout_s: float = 900.0
    extra_args: str = ""  # extra server flags, shell-quoted


@dataclass
class RolloutConfig:
    engine: str = "torch"  # torch (static batches) | continuous (continuous batching) | vllm | sglang (servers)
    num_workers: int = 1
    group_size: int = 8  # n samples per prompt
    max_batch_groups: int = 8  # groups generated together in one engine batch
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    poll_interval_s: float = 0.02
    admission: bool = True  # AReaL's admission rule; off only for tests of the hard bound
    agent: str = ""  # "pkg.module:run" (async run(task, base_url, api_key) -> reward): agent rollouts through the proxy
    workflow: str = (
        ""  # "pkg.module:Name" (ctx) -> RolloutWorkflow; empty: single-turn, or the agent's when agent is set
    )
    server: ServerConfig = field(default_factory=ServerConfig)


@dataclass
class AgentConfig:
    """Agent rollouts, used when rollout.agent is set (docs/proxy.md)."""

    max_concurrent_episodes: int = 32
    episode_timeout_s: float = 300.0
    turn_discount: float = 1.0  # γ for per-turn rewards
    tool_prompt: str = "none"  # none | names | full: how tools are announced to the model
    corpus: str = ""  # "pkg.module:fn" (records) -> texts: the tiny tokenizer's training text
    sft_examples: str = ""  # "pkg.module:fn" (tokenizer, records) -> [(ids, loss_mask)]: warm start episodes
    sft_fraction: float = 1.0  # share of SFT records given as agent episodes; the rest as plain answers


@dataclass
class RewardConfig:
    num_workers: int = 1
    function: str = ""  # "pkg.module:function"; empty: the task's verifier
    pool_size: int = 1
    timeout_s: float = 5.0
    retries: int = 1
    poll_interval_s: float = 0.02


@dataclass
class TrainConfig:
    steps: int = 200
    batch_groups: int = 8  # B: groups per training step
    eta: int = 2  # staleness bound η
    lr: float = 1e-3
    lr_schedule: str = "constant"  # constant | cosine | linear (decay over train.steps, after warmup)
    lr_warmup_steps: int = 0
    lr_min_ratio: float = 0.0  # the decayed rate's floor, as a fraction of train.lr
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    packing: bool = True  # pack sequences without padding for the forward passes
    ppo_minibatches: int = 1
    checkpoint_every: int = 10
    poll_interval_s: float = 0.01
    slow_step_s: float = 0.0  # tests: sleep per step to make training the bottleneck
    eval_every: int = 0  # 0: only before/after
    weight_delta: bool = False  # publish each version as a compressed delta against the previous one
    weight_full_every: int = 8  # with weight_delta: a full snapshot when the version is a multiple of this


@dataclass
class EvalConfig:
    num_samples: int = 500
    batch_size: int = 250
    max_new_tokens: int = 24


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""  # empty: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns.db
    experiment: str = "areal-flyte"


@dataclass
class LauncherConfig:
    timeout_s: float = 1800.0
    progress: bool = True


@dataclass
class RunConfig:
    name: str = "default"
    store: str = "runs/default"  # fsspec URI or local path of the run root
    seed: int = 1
    threads_per_role: int = 1
    device: str = "cpu"  # cpu | cuda | npu
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


_CHOICES = {
    "task.name": {"arithmetic", "gsm8k", "code"},
    "rollout.engine": {"torch", "continuous", "vllm", "sglang"},
    "rollout.server.interrupt": {"keep", "abort"},
    "sft.schedule": {"cosine", "constant"},
    "train.lr_schedule": {"constant", "cosine", "linear"},
    "device": {"cpu", "cuda", "npu"},
}
_POSITIVE = {
    "rollout.num_workers",
    "rollout.group_size",
    "rollout.max_batch_groups",
    "rollout.max_new_tokens",
    "reward.num_workers",
    "reward.pool_size",
    "reward.timeout_s",
    "train.steps",
    "train.batch_groups",
    "train.lr",
    "train.ppo_minibatches",
    "train.checkpoint_every",
    "train.weight_full_every",
    "sft.batch_size",
    "eval.num_samples",
    "eval.batch_size",
    "model.hidden_size",
    "model.num_layers",
    "task.num_train",
    "task.num_eval",
    "threads_per_role",
}
_NON_NEGATIVE = {"train.eta", "sft.steps", "rollout.temperature", "reward.retries", "train.lr_warmup_steps"}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"config key '{key}' has unsupported type {typ}")


def _apply(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}'")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, dotted + ".")
        else:
            setattr(obj, key, _coerce(dotted, value, hints[key]))


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`"train.lr=3e-4"` -> ("train.lr", 3e-4); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML ({exc})") from None
    return key, value


def check_hook(key: str, path: str, coroutine: bool = False) -> None:
    """A 'pkg.module:function' config value must import and be callable (async if `coroutine`)."""
    import asyncio
    import importlib

    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"config key '{key}' must look like 'pkg.module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config key '{key}': cannot import {path!r} ({type(exc).__name__}: {exc})") from None
    if not callable(fn) or (coroutine and not asyncio.iscoroutinefunction(fn)):
        kind = "an async function" if coroutine else "callable"
        raise ConfigError(f"config key '{key}': {path!r} is not {kind}")


def _validate_agent(cfg: RunConfig) -> None:
    a = cfg.agent
    if a.tool_prompt not in {"none", "names", "full"}:
        raise ConfigError(f"config key 'agent.tool_prompt' must be one of none, names, full, got {a.tool_prompt!r}")
    if not 0 <= a.turn_discount <= 1 or not 0 <= a.sft_fraction <= 1:
        raise ConfigError("config keys 'agent.turn_discount' and 'agent.sft_fraction' must be in [0, 1]")
    if a.max_concurrent_episodes < 1 or a.episode_timeout_s <= 0:
        raise ConfigError("config keys 'agent.max_concurrent_episodes' and 'agent.episode_timeout_s' must be > 0")
    if cfg.rollout.workflow:
        check_hook("rollout.workflow", cfg.rollout.workflow)
    if cfg.rollout.agent:
        check_hook("rollout.agent", cfg.rollout.agent, coroutine=True)
        if cfg.train.eval_every:
            raise ConfigError(
                "config key 'train.eval_every' must be 0 with rollout.agent (the evaluate step measures agent success)"
            )
    for key, path in (("agent.corpus", a.corpus), ("agent.sft_examples", a.sft_examples)):
        if path:
            check_hook(key, path)


def _validate_server(cfg: RunConfig) -> None:
    """A remote engine needs a server: a URL, or (vLLM) the interpreter that starts one."""
    srv = cfg.rollout.server
    if srv.kv_cache_mb <= 0 or srv.max_num_seqs <= 0 or srv.threads <= 0:
        raise ConfigError("config keys 'rollout.server.kv_cache_mb/max_num_seqs/threads' must be > 0")
    if cfg.rollout.engine == "sglang" and not srv.url:
        raise ConfigError("config key 'rollout.server.url' is required when rollout.engine is sglang")
    if cfg.rollout.engine == "vllm" and not srv.url and "/" in srv.python:
        from areal_core.rollout.vllm_server import resolve_python

        if not resolve_python(srv.python).exists():
            raise ConfigError(
                f"config key 'rollout.server.python': no vLLM interpreter at {resolve_python(srv.python)} "
                "(run `make vllm-venv`, or set rollout.server.url)"
            )


def validate(cfg: RunConfig) -> RunConfig:
    """Range and choice checks; raises ConfigError naming the first bad key."""
    flat = to_flat_dict(cfg)
    for key, allowed in _CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {sorted(allowed)}, got {flat[key]!r}")
    for key in _POSITIVE:
        if not flat[key] > 0:
            raise ConfigError(f"config key '{key}' must be > 0, got {flat[key]!r}")
    for key in _NON_NEGATIVE:
        if flat[key] < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {flat[key]!r}")
    _validate_server(cfg)
    if cfg.rollout.group_size < 2:
        raise ConfigError("config key 'rollout.group_size' must be >= 2 for group-relative advantages")
    if not 0 <= cfg.train.lr_min_ratio <= 1:
        raise ConfigError(f"config key 'train.lr_min_ratio' must be in [0, 1], got {cfg.train.lr_min_ratio}")
    if not 0 <= cfg.sft.multi_step_fraction <= 1:
        raise ConfigError(f"config key 'sft.multi_step_fraction' must be in [0, 1], got {cfg.sft.multi_step_fraction}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"config key 'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}")
    try:
        cfg.algo.validate()
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if cfg.train.batch_groups % cfg.train.ppo_minibatches:
        raise ConfigError("config key 'train.ppo_minibatches' must divide 'train.batch_groups'")
    if cfg.task.name == "arithmetic":
        if not 1 <= cfg.task.max_steps <= 3:
            raise ConfigError(f"config key 'task.max_steps' must be in 1..3, got {cfg.task.max_steps}")
        if not 0 <= cfg.task.min_value < cfg.task.max_value:
            raise ConfigError("config keys 'task.min_value' < 'task.max_value' required")
        if not cfg.task.ops or set(cfg.task.ops) - set("+-*"):
            raise ConfigError(f"config key 'task.ops' must use only '+-*', got {cfg.task.ops!r}")
    if cfg.task.name == "gsm8k" and not cfg.task.path:
        raise ConfigError("config key 'task.path' is required when task.name is gsm8k")
    if cfg.model.hidden_size % cfg.model.num_heads or cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError("config keys 'model.num_heads' must divide hidden_size and be a multiple of num_kv_heads")
    _validate_agent(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML files (if given; comma-separated paths apply in order), apply dotted
    overrides, validate. Raises ConfigError.

        load_config("configs/default.yaml,configs/algorithms/dapo.yaml", ["train.eta=0"])
    """
    cfg = RunConfig()
    for one in str(path or "").split(","):
        if not one.strip():
            continue
        p = Path(one.strip())
        if not p.is_file():
            raise ConfigError(f"config file '{one.strip()}' does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {str(exc).splitlines()[0]}") from None
        _apply(cfg, data)
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(cfg, _nest(key, value))
    return validate(cfg)


def from_yaml_text(text: str) -> RunConfig:
    """Rebuild a config saved by `to_yaml` (the run root's config.yaml)."""
    cfg = RunConfig()
    _apply(cfg, yaml.safe_load(text) or {})
    return validate(cfg)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(to_dict(cfg), "")
    return out
