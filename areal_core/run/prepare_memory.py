"""Prepare's memory: the copies of a checkpoint its checks make, and the pod that holds them.

The preflight (run/preflight.py) loads a user's checkpoint once, in float32, and shares it:

    lora       the LoRA targets are resolved on `meta_copy(model)`: the modules and shapes, no weights
    agreement  the float32 engine runs on the loaded model itself; a bfloat16 rollout engine gets
               `cast_copy(model, bfloat16)` (half a copy, made tensor by tensor) after the float32
               engine is freed; each engine's KV cache holds the few prompts the check samples

so prepare holds one float32 copy of the weights at a time, plus what the chosen engine builds from
it (the continuous engine's fused qkv and gate/up matrices). A checkpoint whose files exceed
config.pod_memory.MAX_WEIGHT_BYTES is checked on the meta device, without its weights.

The pod that holds it is sized by config/pod_memory.py (`prepare_memory_bytes`, measured on this
mechanism by benchmarks/prepare_memory.py).
"""

from __future__ import annotations

import itertools
from typing import Any


def meta_copy(model: Any) -> Any:
    """A copy of `model` on the meta device: its modules, shapes and dtypes without any weight
    (tied parameters stay tied). What a check that only needs the architecture works on."""
    import torch

    return _copy_tensors(model, lambda t: torch.empty_like(t, device="meta"))


def cast_copy(model: Any, dtype: Any) -> Any:
    """`copy.deepcopy(model).to(dtype)` without the float32 copy in between: each floating-point
    parameter and buffer is cast on its own (others are copied as they are)."""
    return _copy_tensors(model, lambda t: t.to(dtype, copy=True) if t.is_floating_point() else t.clone())


def _copy_tensors(model: Any, make: Any) -> Any:
    """deepcopy(model) with each parameter and buffer replaced by `make(tensor)`, never copied first."""
    import copy

    import torch

    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:  # a tied parameter once
            new = make(t.detach())
            is_param = isinstance(t, torch.nn.Parameter)
            memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
    return copy.deepcopy(model, memo)
