"""What a Hugging Face decoder computes that the project's own code must reproduce: its attention
windows per layer, the masks a packed forward passes for them, its LoRA targets, and which
built-in engine runs it exactly.

Attention windows follow `transformers.masking_utils`: a layer with window w lets query position
q see key position k iff k ≤ q and q − k < w (`sliding_window_overlay`). A config's windows:

    layer_types given (Gemma 2/3, Qwen2/3 with max_window_layers): w on "sliding_attention"
        layers, none on "full_attention" ones
    otherwise (Mistral, Phi-3, Qwen-MoE): config.sliding_window on every layer (None: none)

Any other layer type (chunked, linear attention, ...) is an `UnsupportedArchitecture`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
# Linear layers that are a router, not a projection: never LoRA targets (MoE gates)
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture computes something this project does not reproduce."""


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def attention_windows(config: Any) -> list[int | None]:
    """The attention window of every decoder layer (None: full causal attention)."""
    cfg = _text_config(config)
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None) or None
    types = getattr(cfg, "layer_types", None)
    if types:
        odd = sorted(set(types) - {FULL, SLIDING})
        if odd:
            raise UnsupportedArchitecture(
                f"{cfg.model_type}: attention layer types {odd} are not supported (only {FULL} and {SLIDING})"
            )
        if len(types) != n:
            raise UnsupportedArchitecture(f"{cfg.model_type}: {len(types)} layer_types for {n} layers")
        if SLIDING in types and window is None:
            raise UnsupportedArchitecture(f"{cfg.model_type}: sliding_attention layers but no sliding_window")
        return [int(window) if t == SLIDING else None for t in types]
    return [None if window is None else int(window)] * n


def attention_masks(config: Any, build: Callable[[int | None], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` argument of a packed forward: `build(window)` once when every layer has
    the same window (a 4D mask, used as given), else one mask per layer type (the models with
    mixed layers take a dict keyed by `config.layer_types`' names)."""
    windows = attention_windows(config)
    if len(set(windows)) == 1:
        return build(windows[0])
    by_type = dict(zip(_text_config(config).layer_types, windows))
    return {kind: build(w) for kind, w in by_type.items()}


def window_allowed(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[R, L, L] bool: query i may see key j by distance alone (pos_i − pos_j < window; all where
    window is None). `pos` [R, L] are the rows' position ids; causality and segments are the caller's."""
    if window is None:
        return torch.ones(pos.shape[0], pos.shape[1], pos.shape[1], dtype=torch.bool)
    return (pos[:, :, None] - pos[:, None, :]) < window


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """Names of fused MoE expert weights (3D parameters, [experts, out, in]), which LoRA on linear
    layers cannot reach."""
    return [n for n, p in model.named_parameters() if p.dim() == 3 and ".experts" in n]


def linear_leaf_names(model: torch.nn.Module) -> list[str]:
    """Sorted last names of the nn.Linear modules in the decoder layers, routers excluded: the
    projections of attention and MLP (fused ones included: Phi-3's qkv_proj and gate_up_proj)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in ROUTERS:
                names.add(leaf)
    return sorted(names)


def resolve_lora_targets(model: torch.nn.Module, requested: str = "") -> list[str]:
    """The LoRA target module names for `model`: `requested` (comma-separated last names), each of
    which must name a linear layer of the decoder; empty: every attention and MLP projection.
    UnsupportedArchitecture when the default would leave MoE experts unadapted."""
    available = linear_leaf_names(model)
    if requested.strip():
        wanted = sorted({t.strip() for t in requested.split(",") if t.strip()})
        missing = [t for t in wanted if t not in available]
        if missing:
            raise UnsupportedArchitecture(
                f"train.lora_target_modules names {missing}, which {type(model).__name__} has no linear layer "
                f"called; its decoder's linear layers are {available}"
            )
        return wanted
    experts = expert_parameters(model)
    if experts:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} keeps its routed experts as fused 3D weights ({experts[0]}, ...), which LoRA "
            f"does not adapt; train the whole model (train.lora_rank=0) or name the layers to adapt without the "
            f"experts, e.g. train.lora_target_modules={','.join(available)}"
        )
    if not available:
        raise UnsupportedArchitecture(f"{type(model).__name__} has no linear layers in its decoder for LoRA")
    return available
