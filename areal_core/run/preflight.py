"""Preflight: what prepare checks about the user's model before SFT and before any role starts.

One registry of named checks (`@preflight("name")`), run in order over a `Preflight` context
(the config, the task's training rows, the model and tokenizer once loaded). A check raises
ConfigError naming the config key and the cause; `run_preflight` adds the check's name. Other
checks register the same way: the reward function's in run/preflight_reward.py.

The model checks apply to a checkpoint the user brings (`model.path`; the tiny model is built
by SFT from the project's own supported Qwen2):

    model       it loads, and its attention layers are ones the trainer's packed masks reproduce
    prompts     a chat template exists, or task.prompt_format=plain is chosen
    prompt_length  the longest training prompts plus rollout.max_new_tokens fit the model's context
    engine      rollout.engine=continuous implements the architecture (else: torch or auto)
    lora        the LoRA targets resolve to linear layers and each gets an adapter
    agreement   a few task prompts, sampled by the chosen built-in engine, score the same
                log-probs under the engine, the trainer's packed forward and the HF forward:
                mean |Δ log p| ≤ AGREEMENT_TOL in float32 (a bfloat16 engine's gap is logged)

A checkpoint whose weights exceed MAX_WEIGHT_BYTES is checked on the meta device (its config's
shapes): every check but the agreement, which needs the weights, runs.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_core.config import ConfigError, RunConfig
from areal_core.config.pod_memory import MAX_WEIGHT_BYTES
from areal_core.config.run import is_remote_engine
from areal_core.run.prepare_memory import cast_copy, meta_copy

log = logging.getLogger("areal.preflight")

AGREEMENT_TOL = 1e-5  # mean |Δ log p| in float32 (measured: ≤ 5e-7 max on every supported architecture)
AGREEMENT_PROMPTS = 2
AGREEMENT_TOKENS = 12
PROMPT_LENGTH_PROBES = 64  # the longest training prompts (by characters) tokenized by the prompt_length check
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")  # config and tokenizer files (no .py)
MAX_SIDE_FILE_BYTES = 64 * 1024**2

CHECKS: dict[str, Callable[[Preflight], None]] = {}


def preflight(name: str) -> Callable[[Callable[[Preflight], None]], Callable[[Preflight], None]]:
    """Register a check under `name` (run in registration order)."""

    def register(fn: Callable[[Preflight], None]) -> Callable[[Preflight], None]:
        if name in CHECKS:
            raise ValueError(f"preflight check {name!r} is registered twice")
        CHECKS[name] = fn
        return fn

    return register


@dataclass
class Preflight:
    cfg: RunConfig
    train: list[dict[str, Any]]
    model: Any = None
    tokenizer: Any = None
    weights_loaded: bool = False  # False: the model is on the meta device (its shapes, no weights)
    notes: dict[str, str] = field(default_factory=dict)  # what each check found, for the log

    @property
    def user_model(self) -> bool:
        return bool(self.cfg.model.path) and self.cfg.model.kind == "text"


def run_preflight(cfg: RunConfig, train: list[dict[str, Any]]) -> dict[str, str]:
    """Run every registered check; returns their notes. ConfigError('preflight <name>: ...') on the first failure."""
    ctx = Preflight(cfg, train)
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            check(ctx)
        except ConfigError as exc:
            raise ConfigError(f"preflight {name}: {exc}") from None
        log.info("preflight %s: %s (%.1f s)", name, ctx.notes.get(name, "ok"), time.perf_counter() - t0)
    return ctx.notes


@preflight("model")
def check_model(ctx: Preflight) -> None:
    if not ctx.user_model:
        return
    from areal_core.architecture import UnsupportedArchitecture, attention_windows

    try:
        ctx.model, ctx.tokenizer, ctx.weights_loaded = load_for_checks(ctx.cfg.model.path)
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's checkpoint, named
        raise ConfigError(f"config key 'model.path': cannot load {ctx.cfg.model.path!r}: {exc}"[:600]) from None
    try:
        windows = attention_windows(ctx.model.config)
    except UnsupportedArchitecture as exc:
        raise ConfigError(f"config key 'model.path': {exc}") from None
    slid = sorted({w for w in windows if w})
    ctx.notes["model"] = f"{type(ctx.model).__name__}, {len(windows)} layers" + (f", windows {slid}" if slid else "")


def load_for_checks(path: str) -> tuple[Any, Any, bool]:
    """(model, tokenizer, weights loaded): the checkpoint with its weights when they are at most
    MAX_WEIGHT_BYTES, else its config on the meta device (architecture, engine and LoRA checks
    need no weights; prepare's pod then needs no model-sized memory, and a remote checkpoint is
    read without its weights)."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from areal_core.hf_load import load_config, load_tokenizer
    from areal_core.models import load_pretrained, localize
    from areal_core.store import Store

    remote = "://" in path and not path.startswith("file://")
    if not remote:
        folder = Path(localize(path))
        size = sum(f.stat().st_size for f in folder.glob("*") if f.suffix in WEIGHT_SUFFIXES)
    else:
        store = Store(path)
        size = sum(store.fs.size(store.path(n)) for n in store.listdir("") if Path(n).suffix in WEIGHT_SUFFIXES)
    if size <= MAX_WEIGHT_BYTES and not remote:
        return (*load_pretrained(path), True)
    if size <= MAX_WEIGHT_BYTES:  # downloaded to a folder removed once loaded (the pod's disk holds one copy)
        with tempfile.TemporaryDirectory(prefix="areal-preflight-") as tmp:
            store.get_dir("", tmp)
            return (*load_pretrained(tmp), True)
    with tempfile.TemporaryDirectory(prefix="areal-preflight-") as tmp:
        if remote:  # the config and tokenizer files only (never weights of any format), then removed
            for name in store.listdir(""):
                if Path(name).suffix in SIDE_FILE_SUFFIXES and store.fs.size(store.path(name)) <= MAX_SIDE_FILE_BYTES:
                    Path(tmp, name).write_bytes(store.read_bytes(name, MAX_SIDE_FILE_BYTES))
            folder = Path(tmp)
        config = load_config(folder)
        tokenizer = load_tokenizer(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, False


@preflight("prompts")
def check_prompt_format(ctx: Preflight) -> None:
    if ctx.tokenizer is None or ctx.cfg.task.prompt_format != "chat":
        return
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise ConfigError(
            f"config key 'task.prompt_format': the tokenizer of {ctx.cfg.model.path!r} has no chat template; "
            "set task.prompt_format=plain (questions as plain text, for base models) or use a chat checkpoint"
        )


@preflight("prompt_length")
def check_prompt_length(ctx: Preflight) -> None:
    """The longest training prompts, rendered as the rollout renders them, plus rollout.max_new_tokens
    fit the model's context: a longer sample is quarantined by every reader (protocol.shard_limits_for),
    so a run of them would train on nothing. The PROMPT_LENGTH_PROBES longest by characters are
    tokenized (an agent's prompts are its own: not checked)."""
    if ctx.tokenizer is None or ctx.model is None or ctx.cfg.rollout.agent or not ctx.train:
        return
    from areal_core.models import record_prompt

    text = ctx.model.config.get_text_config()
    context = getattr(text, "max_position_embeddings", None)
    if not context:
        return

    def chars(r: dict[str, Any]) -> int:
        return len(r["prompt"]) + sum(len(m["content"]) for m in (r.get("meta") or {}).get("chat") or [])

    longest = sorted(ctx.train, key=chars, reverse=True)[:PROMPT_LENGTH_PROBES]
    task, new = ctx.cfg.task, ctx.cfg.rollout.max_new_tokens
    lengths = [(len(record_prompt(ctx.tokenizer, r, task.system_prompt, task.prompt_format)), r) for r in longest]
    over = [(n, r) for n, r in lengths if n + new > context]
    if over:
        n, r = max(over, key=lambda x: x[0])
        raise ConfigError(
            f"config key 'rollout.max_new_tokens': {len(over)} of the {len(longest)} longest training prompts leave "
            f"no room for {new} new tokens in the model's context of {context} (the longest, {r.get('prompt_id')!r}, "
            f"is {n} tokens): such samples would be refused by every reader; shorten or drop those prompts, or lower "
            "rollout.max_new_tokens"
        )
    ctx.notes["prompt_length"] = f"longest prompt {max(n for n, _ in lengths)} tokens + {new} new <= {context}"


@preflight("engine")
def check_engine(ctx: Preflight) -> None:
    if ctx.model is None or ctx.cfg.rollout.engine not in ("continuous", "auto"):
        return
    from areal_core.rollout.engine_choice import choose_local_engine, replays_routes
    from areal_core.rollout.static_cache import UnsupportedModel, check_supported

    if ctx.cfg.rollout.engine == "continuous":
        try:
            check_supported(ctx.model)
        except UnsupportedModel as exc:
            raise ConfigError(f"config key 'rollout.engine': {exc}") from None
    ctx.notes["engine"] = choose_local_engine(ctx.cfg.rollout.engine, ctx.model, replays_routes(ctx.cfg)).line()


@preflight("attention")
def check_attention(ctx: Preflight) -> None:
    """train.packed_attention=segments needs a model on sdpa (segment_attention.py); known from its config."""
    if ctx.model is None or ctx.cfg.train.packed_attention != "segments":
        return
    from areal_core.train.segment_attention import NAME

    impl = getattr(ctx.model.config, "_attn_implementation", None)
    if impl not in ("sdpa", NAME):
        raise ConfigError(
            f"config key 'train.packed_attention': segments needs sdpa attention, and "
            f"{type(ctx.model).__name__} runs {impl}: use auto (it keeps such a model on masks) or mask"
        )
    ctx.notes["attention"] = "packed rows attend per span"


@preflight("lora")
def check_lora(ctx: Preflight) -> None:
    if ctx.model is None or ctx.cfg.train.lora_rank <= 0:
        return
    from areal_core.architecture import UnsupportedArchitecture
    from areal_core.train.lora import adapted_names, apply_lora

    train = ctx.cfg.train
    try:  # on a weightless copy: the targets are a question of module names and shapes
        wrapped = apply_lora(
            meta_copy(ctx.model), train.lora_rank, train.lora_alpha, target_modules=train.lora_target_modules
        )
    except UnsupportedArchitecture as exc:
        raise ConfigError(f"config key 'train.lora_target_modules': {exc}") from None
    ctx.notes["lora"] = "adapts " + ",".join(adapted_names(wrapped))


@preflight("agreement")
def check_agreement(ctx: Preflight) -> None:
    cfg = ctx.cfg
    rows = [r for r in ctx.train[:AGREEMENT_PROMPTS] if isinstance(r.get("prompt"), str)]
    if ctx.model is None or is_remote_engine(cfg.rollout.engine) or not rows:
        return
    if not ctx.weights_loaded:
        ctx.notes["agreement"] = (
            f"skipped: weights over {MAX_WEIGHT_BYTES // 1024**3} GiB are not loaded at prepare; the first steps' "
            "abs_dlogp_behav_prox (at η = 0 the engine/trainer gap alone) shows it"
        )
        return
    gaps = measure_agreement(ctx.model, ctx.tokenizer, cfg, rows)
    ctx.notes["agreement"] = f"mean |Δ log p| vs {type(ctx.model).__name__}: " + ", ".join(
        f"{k} {v:.1e}" for k, v in gaps.items() if k != "kind"
    )
    if gaps["trainer"] > AGREEMENT_TOL:
        raise ConfigError(
            f"the trainer's packed forward differs from {type(ctx.model).__name__}'s own forward by "
            f"{gaps['trainer']:.2e} mean |Δ log p| (tolerance {AGREEMENT_TOL:g}); set train.packing=false"
        )
    if gaps["engine_fp32"] > AGREEMENT_TOL:
        raise ConfigError(
            f"config key 'rollout.engine': the {gaps['kind']} engine's log-probs differ from "
            f"{type(ctx.model).__name__}'s own forward by {gaps['engine_fp32']:.2e} mean |Δ log p| "
            f"(tolerance {AGREEMENT_TOL:g}); use rollout.engine=torch"
        )
    if "engine" in gaps and gaps["engine"] > AGREEMENT_TOL:
        log.warning(
            "preflight agreement: the rollout engine in %s samples with log-probs %.2e (mean |Δ|) from the "
            "trainer's float32 ones: importance weights start away from 1 (rollout.dtype=float32 removes it)",
            cfg.rollout.dtype,
            gaps["engine"],
        )


def measure_agreement(model: Any, tokenizer: Any, cfg: RunConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean |Δ log p| against the HF forward (float32, one sequence at a time, no padding) of the
    tokens the rollout engine samples for `rows`: `engine_fp32` (the engine in float32),
    `engine` (in rollout.dtype, when that is not float32) and `trainer` (the packed forward the
    trainer runs); `kind` is the engine."""
    from areal_core.models import record_prompt
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.factory import build_local_engine, local_engine_kind, rollout_dtype
    from areal_core.train.logprobs import token_logprobs
    from areal_core.train.packing import packed_token_logprobs

    model = model.float().eval()
    prompts = [record_prompt(tokenizer, r, cfg.task.system_prompt, cfg.task.prompt_format) for r in rows]
    params = SamplingParams(max_new_tokens=AGREEMENT_TOKENS, temperature=cfg.rollout.temperature, seed=cfg.seed)
    dtypes = [torch.float32] + ([rollout_dtype(cfg)] if rollout_dtype(cfg) != torch.float32 else [])
    tau = cfg.rollout.temperature
    out: dict[str, Any] = {"kind": local_engine_kind(cfg.rollout.engine, model)}
    sized = engine_config(cfg, len(prompts))
    for dtype in dtypes:  # float32: the engine runs the model itself; else a cast copy, freed after
        engine = build_local_engine(sized, engine_weights(model, dtype), tokenizer, version=0, seed=cfg.seed)
        gens = engine.generate(prompts, params)
        del engine
        gc.collect()
        seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
        with torch.no_grad():
            ones = [torch.ones(1, len(s), dtype=torch.long) for s in seqs]
            hf = [token_logprobs(model, torch.tensor([s]), one, tau)[0] for s, one in zip(seqs, ones)]

        name = "engine_fp32" if dtype == torch.float32 else "engine"
        out[name] = _mean_gap([(h[len(p) :], g.logprobs) for h, p, g in zip(hf, prompts, gens)])
        if dtype != torch.float32:
            continue
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            if cfg.train.packing:  # one group of both rows: the tree pack the trainer uses for a group
                group = torch.zeros(len(seqs), dtype=torch.long)
                lp = packed_token_logprobs(model, ids, mask, tau, pad_id=tokenizer.pad_token_id or 0, group_index=group)
            else:
                lp = token_logprobs(model, ids, mask, tau)
        out["trainer"] = _mean_gap([(h[1:], lp[i, 1 : len(s)]) for i, (h, s) in enumerate(zip(hf, seqs))])
    return out


def engine_config(cfg: RunConfig, prompts: int) -> RunConfig:
    """The run's config with the rollout engine's batch sized to the `prompts` the agreement samples:
    the continuous engine's KV cache is then `prompts` rows, not max_batch_groups · group_size."""
    rollout = cfg.rollout.model_copy(update={"max_batch_groups": 1, "group_size": prompts})
    return cfg.model_copy(update={"rollout": rollout})


def engine_weights(model: Any, dtype: torch.dtype) -> Any:
    """The model a preflight engine in `dtype` runs: `model` itself in its own dtype (the engines
    only read it), else a copy cast tensor by tensor (run/prepare_memory.py)."""
    return model if next(model.parameters()).dtype == dtype else cast_copy(model, dtype)


def _mean_gap(pairs: list[tuple[Any, Any]]) -> float:
    a = torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x, _ in pairs])
    b = torch.cat([torch.as_tensor(y, dtype=torch.float64).reshape(-1) for _, y in pairs])
    return float((a - b).abs().mean()) if a.numel() else 0.0
