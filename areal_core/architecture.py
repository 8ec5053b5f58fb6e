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

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


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


# -- LoRA targets ---------------------------------------------------------------------------------

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek's latent attention
GATED_MLP = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # routed experts, [experts, ·, ·] each
# Routers (never a default target; a user may name them): the linear ones by last name, the others
# (transformers' TopKRouter modules) are parameters such as mlp.gate.weight
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
_DECODER_LAYER = re.compile(r"(^|\.)(layers|h)\.\d+\.")  # model.layers.3.… (Llama family), transformer.h.3.… (GPT-2)


@dataclass(frozen=True)
class LoraTargets:
    """What LoRA adapts: `modules` by last name (nn.Linear, GPT-2's Conv1D: peft's target_modules)
    and `parameters` by the end of their name (fused MoE expert weights [experts, ·, ·]: peft's
    target_parameters, in the order the published adapter lists them)."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()


# model_type -> default targets: attention (MLA's projections included), dense MLPs, shared experts
# and the routed experts; routers stay frozen. A name the checkpoint lacks is left out (DeepSeek's
# q_proj when q_lora_rank is set; its q_a_proj/q_b_proj when not). transformers 5 keeps the routed
# experts of every MoE below fused (no per-expert linear modules): they are adapted as parameters.
LORA_TARGETS: dict[str, LoraTargets] = {
    "qwen2_moe": LoraTargets(ATTENTION + GATED_MLP, FUSED_EXPERTS),  # GATED_MLP: the shared expert
    "qwen3_moe": LoraTargets(ATTENTION + GATED_MLP, FUSED_EXPERTS),  # GATED_MLP: mlp_only_layers
    "mixtral": LoraTargets(ATTENTION, FUSED_EXPERTS),
    "deepseek_v2": LoraTargets(MLA + GATED_MLP, FUSED_EXPERTS),  # GATED_MLP: dense layers, shared experts
    "deepseek_v3": LoraTargets(MLA + GATED_MLP, FUSED_EXPERTS),
    "gpt_oss": LoraTargets(ATTENTION, FUSED_EXPERTS),
    "gpt2": LoraTargets(("c_attn", "c_proj", "c_fc")),  # Conv1D layers (weights stored [in, out])
}


def _decoder_names(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if _DECODER_LAYER.search(n)]


def layer_relative(name: str) -> str:
    """'model.layers.3.mlp.experts.down_proj' -> 'mlp.experts.down_proj'."""
    return _DECODER_LAYER.split(name, maxsplit=1)[-1]


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """The fused MoE expert weights (3D, [experts, ·, ·]) by their name within a decoder layer, in
    the order the model registers them ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')."""
    names = [layer_relative(n) for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n]
    return list(dict.fromkeys(n for n in names if n))


def linear_leaf_names(model: torch.nn.Module, routers: bool = False) -> list[str]:
    """Sorted last names of the decoder layers' nn.Linear and Conv1D (GPT-2) modules: the
    projections of attention and MLP (fused ones included: Phi-3's qkv_proj), routers only if asked."""
    from transformers.pytorch_utils import Conv1D

    leaves = {n.rsplit(".", 1)[-1] for n, m in _decoder_names(model) if isinstance(m, (torch.nn.Linear, Conv1D))}
    return sorted(leaves if routers else leaves - ROUTERS)


def _parameter_suffixes(model: torch.nn.Module) -> set[str]:
    """Every ending (of at least two parts) of the decoder layers' 2D and 3D parameter names."""
    out = set()
    for name, p in model.named_parameters():
        if p.dim() in (2, 3) and _DECODER_LAYER.search(name):
            parts = layer_relative(name).split(".")
            out.update(".".join(parts[i:]) for i in range(len(parts) - 1))
    return out


def lora_targets(model: torch.nn.Module, requested: str = "") -> LoraTargets:
    """The LoRA targets of `model`. `requested` (train.lora_target_modules): comma-separated names,
    a last name of a linear layer (q_proj; a router too when named) or a dotted parameter name
    (mlp.experts.gate_up_proj, mlp.gate.weight), each of which must exist; empty: the architecture's
    defaults (LORA_TARGETS; for another model_type every linear projection and fused expert weight)."""
    if requested.strip():
        return _requested_targets(model, requested)
    entry = LORA_TARGETS.get(getattr(_text_config(model.config), "model_type", ""))
    linear, params = linear_leaf_names(model), _parameter_suffixes(model)
    experts = expert_parameters(model)
    if entry is None:
        targets = LoraTargets(tuple(linear), tuple(experts))
    else:
        targets = LoraTargets(
            tuple(m for m in entry.modules if m in linear), tuple(p for p in entry.parameters if p in params)
        )
        left = sorted(set(experts) - set(targets.parameters))
        if left:
            raise UnsupportedArchitecture(f"{type(model).__name__}: LORA_TARGETS leaves expert weights {left} out")
    if not targets.modules and not targets.parameters:
        raise UnsupportedArchitecture(f"{type(model).__name__} has no linear layers in its decoder for LoRA")
    return targets


def _requested_targets(model: torch.nn.Module, requested: str) -> LoraTargets:
    wanted = list(dict.fromkeys(t.strip() for t in requested.split(",") if t.strip()))
    modules = sorted(t for t in wanted if "." not in t)
    parameters = tuple(t for t in wanted if "." in t)
    linear = linear_leaf_names(model, routers=True)
    missing = [t for t in modules if t not in linear]
    if missing:
        raise UnsupportedArchitecture(
            f"train.lora_target_modules names {missing}, which {type(model).__name__} has no linear layer "
            f"called; its decoder's linear layers are {linear}"
        )
    unknown = [t for t in parameters if t not in _parameter_suffixes(model)]
    if unknown:
        raise UnsupportedArchitecture(
            f"train.lora_target_modules names parameters {unknown}, which {type(model).__name__}'s decoder layers "
            f"lack; its fused expert weights are {expert_parameters(model)}"
        )
    return LoraTargets(tuple(modules), parameters)


def resolve_lora_targets(model: torch.nn.Module, requested: str = "") -> list[str]:
    """Every LoRA target of `model` by name: modules, then parameters (`lora_targets`)."""
    targets = lora_targets(model, requested)
    return [*targets.modules, *targets.parameters]
