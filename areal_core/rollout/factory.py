"""The engine `rollout.engine` names, built at a published weight version.

In process: "torch" (static batches, `torch_engine.py`) or "continuous" (continuous batching
over a pre-allocated KV cache, `continuous_engine.py`), over the model loaded here. Remote:
"vllm" (a server started here, or the one at `rollout.server.url`) or "sglang" (at
`rollout.server.url`); only the tokenizer is loaded here.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_core.config import RunConfig
from areal_core.layout import LAYOUT
from areal_core.models import load_pretrained
from areal_core.store import Store
from areal_core.weights.reader import load_state_dict

REMOTE_ENGINES = ("vllm", "sglang")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of an HF checkpoint folder/URI (a remote engine needs no local model)."""
    from transformers import AutoTokenizer

    from areal_core.logs import quiet_libraries
    from areal_core.models import localize

    quiet_libraries()
    return AutoTokenizer.from_pretrained(localize(path))


def build_engine(cfg: RunConfig, store: Store, version: int, index: int = 0) -> tuple[Any, Any]:
    """(engine, tokenizer): the engine of rollout worker `index` serving weights/v{version}."""
    if cfg.rollout.engine in REMOTE_ENGINES:
        tokenizer = load_tokenizer(store.url(LAYOUT.init_model))
        return build_remote_engine(cfg, store, version, tokenizer.eos_token_id, index), tokenizer
    model, tokenizer = load_pretrained(store.url(LAYOUT.init_model), cfg.device)
    model.load_state_dict(load_state_dict(store, version), strict=False)
    model.to(getattr(torch, cfg.rollout.dtype))  # later versions are cast as they are loaded
    return build_local_engine(cfg, model, tokenizer, version, seed=cfg.seed * 7919 + index), tokenizer


def build_local_engine(cfg: RunConfig, model: Any, tokenizer: Any, version: int, seed: int) -> Any:
    """An engine over `model` in this process."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    mid = cfg.rollout.swap_mid_generation
    if cfg.rollout.engine == "continuous":
        from areal_core.rollout.continuous_engine import ContinuousEngine

        slots = cfg.rollout.max_batch_groups * cfg.rollout.group_size
        return ContinuousEngine(
            model, pad, eos, version, seed=seed, slots=slots, tokenizer=tokenizer, swap_mid_generation=mid
        )
    from areal_core.rollout.torch_engine import TorchEngine

    return TorchEngine(model, pad, eos, version, seed=seed, swap_mid_generation=mid)


def build_remote_engine(cfg: RunConfig, store: Store, version: int, eos_id: int | None, index: int = 0) -> Any:
    """A VLLMEngine (started here, or at rollout.server.url) or an SGLangEngine (at rollout.server.url)."""
    srv = cfg.rollout.server
    if cfg.rollout.engine == "vllm":
        from areal_core.rollout.vllm_engine import VLLMEngine
        from areal_core.rollout.vllm_server import server_spec

        if srv.url:
            return VLLMEngine(srv.url, version, eos_id, interrupt=srv.interrupt, store=store)
        return VLLMEngine.launch(store, version, eos_id, server_spec(cfg, index), interrupt=srv.interrupt)
    if cfg.rollout.engine == "sglang":
        from areal_core.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(srv.url, version, eos_id, store=store)
    raise ValueError(f"not a remote engine: {cfg.rollout.engine!r}")
