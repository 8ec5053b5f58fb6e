"""LoRA adapter versions: what a LoRA run publishes, and how a consumer turns it into weights.

A LoRA run publishes weights/v{N}/ as peft's on-disk pair (`adapter_model.safetensors`,
`adapter_config.json`, a few MB) instead of the model; the base it applies to is the run's
`init_model/` (the model the trainer wrapped). A consumer folds it into the base weights:

    W = W_base + s · B @ A,    s = alpha / r   (alpha / √r with rsLoRA)

for every adapted linear layer (A: [r, in], B: [out, r]; Conv1D weights are [in, out], so ΔW is
transposed) and, per expert, for every fused MoE expert weight peft's `target_parameters` adapted
(`lora_delta`; the config's `parameter_layouts` says how each is laid out). Only the adapted
weights change, so a consumer that holds the base model loads just those (`merged_weights`, in the
model's own parameter names), and a server that loads a whole checkpoint gets base + merged
(`reader.stage_verified`, in the checkpoint's names: transformers saves fused experts per expert).
Merging is always from the base, never on top of a previous version: loading versions in any order
gives the same weights.
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load as st_load

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_scale(cfg: dict) -> float:
    """s = alpha / r, or alpha / √r with rsLoRA."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1 or type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ValueError(f"adapter_config.json needs an integer r >= 1 and a finite lora_alpha, got {r!r}, {alpha!r}")
    return alpha / (r**0.5 if cfg.get("use_rslora") else r)


def adapter_target(key: str, order: list[str], fan_in_fan_out: bool) -> tuple[str, str]:
    """(base parameter name, its layout) that the adapter tensors under `key` adapt.

    `key` is peft's module path (the saved tensor name up to '.lora_A.', 'base_model.model.' removed).
    A module's adapter ('model.layers.0.self_attn.q_proj') adapts its `.weight`: [out, in], or
    [in, out] with fan_in_fan_out (GPT-2's Conv1D). Parameters (peft's target_parameters, listed in
    `order` innermost wrapper first) are wrapped one inside the other on their module, so
    'model.layers.0.mlp.experts' is the outermost wrapper's (the last of that module's targets in
    `order`: down_proj) and each '.base_layer' goes one wrapper in ('…experts.base_layer': gate_up_proj).
    The layout is then the adapter config's `parameter_layouts` entry, filled in by the caller."""
    depth = 0
    while key.endswith(".base_layer"):
        key, depth = key.removesuffix(".base_layer"), depth + 1
    module = key.replace(".base_layer", "")
    here = [t for t in order if f".{module}".endswith("." + t.rsplit(".", 1)[0])]
    if not here:
        if depth:
            raise ValueError(f"adapter tensors under {key}{'.base_layer' * depth} match no target parameter")
        return f"{module}.weight", "[in, out]" if fan_in_fan_out else "[out, in]"
    if depth >= len(here):
        raise ValueError(f"adapter tensors under {key}{'.base_layer' * depth}: {module} has {len(here)} targets")
    target = here[len(here) - 1 - depth]
    return f"{module}.{target.rsplit('.', 1)[1]}", target


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, r: int, layout: str) -> torch.Tensor:
    """ΔW of one adapted weight in float32, from A [E·r, in] and B [out, E·r] (E = 1 but for experts):

    [out, in]            ΔW = s · B @ A                      (nn.Linear, a 2D parameter)
    [in, out]            ΔW = (s · B @ A)ᵀ                   (Conv1D)
    [experts, out, in]   ΔW_e = s · B_e @ A_e,   A_e = A.view(E, r, in)[e],  B_e = B.view(out, r, E)[:, :, e]
    [experts, in, out]   ΔW_e = (s · B_e @ A_e)ᵀ             (peft's ParamWrapper on 3D weights)"""
    a, b = a.float(), b.float()
    if layout in ("[out, in]", "[in, out]"):
        delta = scale * (b @ a)
        return delta.T if layout == "[in, out]" else delta
    if layout not in ("[experts, out, in]", "[experts, in, out]"):
        raise ValueError(f"unknown weight layout {layout!r}")
    experts = a.shape[0] // r
    if a.shape[0] != experts * r or b.shape[1] != experts * r:
        raise ValueError(f"expert adapter shapes {tuple(b.shape)}@{tuple(a.shape)} do not hold rank {r} per expert")
    delta = scale * torch.einsum("ore,eri->eoi", b.view(b.shape[0], r, experts), a.view(experts, r, a.shape[1]))
    return delta.transpose(1, 2) if layout == "[experts, in, out]" else delta


def adapter_deltas(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """{base parameter name (the model's own names): ΔW} of a published adapter (`lora_delta`).
    ValueError on a malformed adapter: an A without its B, a target parameter with no layout."""
    cfg = json.loads(files[ADAPTER_CONFIG])
    scale, r = lora_scale(cfg), cfg["r"]
    order = list(cfg.get("target_parameters") or [])
    layouts = cfg.get("parameter_layouts") or {}
    tensors = st_load(files[ADAPTER_WEIGHTS])
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"adapter holds {key} without its lora_B")
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        name, layout = adapter_target(module, order, bool(cfg.get("fan_in_fan_out")))
        if layout in order:
            if layout not in layouts:
                raise ValueError(f"adapter_config.json gives no parameter_layouts entry for {layout!r}")
            layout = layouts[layout]
        out[name] = lora_delta(a, b, scale, r, layout)
    return out


@torch.no_grad()
def merged_weights(base: dict[str, torch.Tensor], files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """{name: W_base + ΔW} for every adapted weight (new tensors; `base` unchanged), in the model's
    own parameter names (`adapter_deltas`). `base` holds at least the adapted weights. ValueError
    names a weight the base lacks or holds in another shape."""
    out = {}
    for name, delta in adapter_deltas(files).items():
        w = base.get(name)
        if w is None:
            raise ValueError(f"adapter names {name!r}, which the base model does not have")
        if tuple(w.shape) != tuple(delta.shape):
            raise ValueError(f"adapter for {name!r} has shape {tuple(delta.shape)}, base {tuple(w.shape)}")
        out[name] = (w.float() + delta).to(w.dtype)
    return out
