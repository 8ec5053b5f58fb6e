"""The in-process engines by `rollout.engine`: "torch" (static batches) or "continuous"
(continuous batching over a pre-allocated KV cache, `continuous_engine.py`)."""

from __future__ import annotations

from typing import Any

from areal_core.config import RunConfig


def build_local_engine(cfg: RunConfig, model: Any, tokenizer: Any, version: int, seed: int) -> Any:
    """An engine over `model` in this process (the remote engines are built elsewhere)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if cfg.rollout.engine == "continuous":
        from areal_core.rollout.continuous_engine import ContinuousEngine

        slots = cfg.rollout.max_batch_groups * cfg.rollout.group_size
        return ContinuousEngine(model, pad, eos, version, seed=seed, slots=slots, tokenizer=tokenizer)
    from areal_core.rollout.torch_engine import TorchEngine

    return TorchEngine(model, pad, eos, version, seed=seed)
