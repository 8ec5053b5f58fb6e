"""The engine `rollout.engine` names, built at a published weight version.

In process: "torch" (static batches, `torch_engine.py`), "continuous" (continuous batching
over a pre-allocated KV cache, `continuous_engine.py`) or "auto" (continuous where it implements
the architecture, else torch), over the model loaded here. Remote:
"vllm" (a server started here, or the one at `rollout.server.url`) or "sglang" (at
`rollout.server.url`); only the tokenizer is loaded here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from areal_core.config import RunConfig
from areal_core.config.device import use_bf16
from areal_core.config.run import is_remote_engine
from areal_core.layout import LAYOUT
from areal_core.models import load_pretrained
from areal_core.rollout.engine_choice import choose_local_engine, choose_remote_engine, replays_routes
from areal_core.store import Store
from areal_core.weights.reader import load_state_dict

log = logging.getLogger("areal.rollout")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of an HF checkpoint folder/URI (a remote engine needs no local model)."""
    from areal_core.hf_load import load_tokenizer as load_folder_tokenizer
    from areal_core.logs import quiet_libraries
    from areal_core.models import localize

    quiet_libraries()
    return load_folder_tokenizer(localize(path))


def build_engine(cfg: RunConfig, store: Store, version: int, index: int = 0) -> tuple[Any, Any]:
    """(engine, tokenizer): the engine of rollout worker `index` serving weights/v{version}; its
    `choice` attribute says which engine rollout.engine chose and why (engine_choice.py)."""
    if is_remote_engine(cfg.rollout.engine):
        tokenizer = load_tokenizer(store.url(LAYOUT.init_model))
        engine = build_remote_engine(cfg, store, version, tokenizer.eos_token_id, index)
        engine.choice = choose_remote_engine(cfg.rollout.engine)
        return engine, tokenizer
    model, tokenizer = load_pretrained(store.url(LAYOUT.init_model), cfg.device)
    model.load_state_dict(load_state_dict(store, version), strict=False)
    model.to(rollout_dtype(cfg))  # later versions are cast as they are loaded
    return build_local_engine(cfg, model, tokenizer, version, seed=cfg.seed * 7919 + index), tokenizer


def rollout_dtype(cfg: RunConfig) -> Any:
    """The built-in engines' weight dtype: rollout.dtype, with "auto" bfloat16 only where it is fast."""
    choice = {"bfloat16": True, "float32": False}.get(cfg.rollout.dtype, "auto")
    return torch.bfloat16 if use_bf16(choice, cfg.device) else torch.float32


def local_engine_kind(choice: str, model: Any, needs_routes: bool = False) -> str:
    """The built-in engine `rollout.engine` runs `model` with: "auto" is "continuous" where the
    continuous engine implements the architecture (`static_cache.check_supported`), else "torch"
    (the model's own forward); `engine_choice.choose_local_engine` says why."""
    return choose_local_engine(choice, model, needs_routes).engine


def build_local_engine(cfg: RunConfig, model: Any, tokenizer: Any, version: int, seed: int) -> Any:
    """An engine over `model` in this process."""
    choice = choose_local_engine(cfg.rollout.engine, model, replays_routes(cfg))
    log.info("%s", choice.line())
    engine = _local_engine(cfg, choice.engine, model, tokenizer, version, seed)
    engine.choice = choice
    return engine


def _local_engine(cfg: RunConfig, kind: str, model: Any, tokenizer: Any, version: int, seed: int) -> Any:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    mid = cfg.rollout.swap_mid_generation
    if kind == "continuous":
        from areal_core.rollout.continuous_engine import ContinuousEngine

        slots = cfg.rollout.max_batch_groups * cfg.rollout.group_size
        return ContinuousEngine(
            model,
            pad,
            eos,
            version,
            seed=seed,
            slots=slots,
            tokenizer=tokenizer,
            swap_mid_generation=mid,
            step_delay_s=cfg.rollout.step_delay_s,
            reprefill_budget=cfg.rollout.reprefill_budget_tokens,
        )
    from areal_core.rollout.torch_engine import TorchEngine

    budget = cfg.rollout.reprefill_budget_tokens
    return TorchEngine(model, pad, eos, version, seed=seed, swap_mid_generation=mid, reprefill_budget=budget)


def vllm_native_lora(cfg: RunConfig, store: Store | None = None, server_device: str | None = None) -> bool:
    """Whether vLLM serves a LoRA run's versions as adapters by name (native LoRA) or merged into
    whole checkpoints: `rollout.server.lora`; auto is merged on a CPU server, where four native-LoRA
    SmolLM2 runs learned less than all seven built-in and merged-reload runs (0.24–0.345 against
    0.36–0.57 held-out, docs/benchmarks.md) while at a fixed adapter in float32 both sample the same
    policy, and native elsewhere (vLLM's GPU LoRA kernels; an adapter swap costs 0.27 s, a merged
    reload 2.9 s), but for an MoE whose default adapter holds fused expert weights (`store`'s
    init_model; vLLM's native reading of those is per model class and untested here: docs/vllm.md).
    The server's device: `server_device`, what the server at rollout.server.url answers
    (`server_device_for_lora`; "unknown" counts as CPU), else `device` (a server this worker starts
    runs on this machine)."""
    mode = cfg.rollout.server.lora
    if "AREAL_VLLM_LORA" in os.environ:  # the variable this setting replaced
        log.warning("AREAL_VLLM_LORA is ignored: set rollout.server.lora (native | merged | auto) instead")
    if mode == "auto":
        cpu = (server_device or cfg.device) in ("cpu", "unknown")
        mode = "merged" if cpu or _expert_adapter(store) else "native"
    return cfg.train.lora_rank > 0 and mode == "native"


def server_device_for_lora(cfg: RunConfig) -> str | None:
    """The device of the vLLM server at rollout.server.url when `rollout.server.lora=auto` must
    choose for a LoRA run (vllm_engine.ask_server_device), else None. A server that answers without
    a device (no worker extension, an old vLLM, a bad answer) is "unknown", served merged as on CPU,
    with a warning naming the url; one that does not answer raises VLLMEngineError naming it."""
    srv = cfg.rollout.server
    if not srv.url or srv.lora != "auto" or cfg.train.lora_rank <= 0:
        return None
    from areal_core.rollout.vllm_engine import ask_server_device

    device, why = ask_server_device(srv.url)
    if device == "unknown":
        log.warning(
            "rollout.server.lora=auto: the vLLM server at %s did not say its device (%s; the worker extension "
            "vllm_worker_ext.ReloadExtension answers it, docs/vllm.md): LoRA versions are served merged, as on a CPU "
            "server; set rollout.server.lora=native or merged to choose",
            srv.url,
            why,
        )
    return device


def _expert_adapter(store: Store | None) -> bool:
    """Whether the run's init_model is an MoE whose default LoRA targets its fused expert weights."""
    from areal_core.architecture import LORA_TARGETS

    if store is None or not store.exists(LAYOUT.init_config):
        return False
    entry = LORA_TARGETS.get(str(store.read_json(LAYOUT.init_config).get("model_type")))
    return bool(entry and entry.parameters)


def build_remote_engine(cfg: RunConfig, store: Store, version: int, eos_id: int | None, index: int = 0) -> Any:
    """A VLLMEngine (started here, or at rollout.server.url) or an SGLangEngine (at rollout.server.url)."""
    srv = cfg.rollout.server
    if cfg.rollout.engine == "vllm":
        from areal_core.rollout.vllm_engine import VLLMEngine
        from areal_core.rollout.vllm_server import server_spec

        native = vllm_native_lora(cfg, store, server_device_for_lora(cfg))
        if srv.url:
            engine = VLLMEngine(srv.url, version, eos_id, interrupt=srv.interrupt, store=store, lora=native)
            if native:  # the server at the URL runs init_model with --enable-lora and sees this host's disk
                engine.serve_adapter(store, version)
            return engine
        spec = server_spec(cfg, index, native_lora=native)
        return VLLMEngine.launch(store, version, eos_id, spec, interrupt=srv.interrupt, native_lora=native)
    if cfg.rollout.engine == "sglang":
        from areal_core.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(srv.url, version, eos_id, store=store)
    raise ValueError(f"not a remote engine: {cfg.rollout.engine!r}")
