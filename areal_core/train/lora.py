"""LoRA (via peft) as an alternative to full fine-tuning, adapter-only weight publication, and a
gradient-checkpointing toggle.

Publication: `adapter_files(model)` gives {"adapter_model.safetensors", "adapter_config.json"}
(peft's on-disk format, a few MB instead of the full model), which the trainer publishes as a
version (`WeightPublisher.publish_adapter`). Consumers merge it into the base weights with
`weights.adapter.merged_weights` (W + scale·B·A): no peft on the inference side.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import save as st_save

from areal_core.architecture import LoraTargets, UnsupportedArchitecture, layer_relative, lora_targets
from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_target, merged_weights


def apply_lora(
    model,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: str | tuple[str, ...] = "",
    rslora: bool = False,
):
    """Wrap a causal LM with LoRA adapters; only the adapters are trainable. Returns the PeftModel.

    `target_modules`: the names to adapt (a tuple, or comma-separated as `train.lora_target_modules`
    gives them): last names of linear layers, dotted names of parameters (fused MoE experts); empty:
    the architecture's defaults (`architecture.lora_targets`). UnsupportedArchitecture when a name
    matches nothing, or when a resolved name ends up without an adapter."""
    from peft import LoraConfig, get_peft_model

    requested = target_modules if isinstance(target_modules, str) else ",".join(target_modules)
    targets = peft_safe(model, lora_targets(model, requested))
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters) or None,
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    adapted = set(adapted_names(peft_model)) | {p for p, _ in wrapped_parameters(peft_model)}
    missing = [t for t in (*targets.modules, *targets.parameters) if t not in adapted]
    if missing:
        raise UnsupportedArchitecture(f"LoRA targets {missing} got no adapter in {type(model).__name__}")
    return peft_model


# peft (0.21) reads these names, on the MoE classes transformers 5 fused, as transformers 4's
# per-expert layers: it retargets them to the fused expert weights (gate_up_proj at twice the rank)
# and drops the dense MLPs and shared experts they also name. Named by their weight instead (a
# target parameter, adapted as the same B @ A), they stay what they are.
PEFT_MOE_RENAMED = frozenset({"gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3"})


def peft_safe(model, targets: LoraTargets) -> LoraTargets:
    """`targets` as peft adapts them exactly: on a model with fused experts (target parameters),
    the linear layers called PEFT_MOE_RENAMED are named by their weights ('mlp.shared_expert.gate_proj.weight')."""
    if not targets.parameters or not PEFT_MOE_RENAMED & set(targets.modules):
        return targets
    moved = {t for t in targets.modules if t in PEFT_MOE_RENAMED}
    weights = [
        f"{layer_relative(name)}.weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in moved and layer_relative(name) != name
    ]
    modules = tuple(t for t in targets.modules if t not in moved)
    return LoraTargets(modules, (*targets.parameters, *dict.fromkeys(weights)))


def adapted_names(peft_model) -> list[str]:
    """Sorted last names of the modules that carry a LoRA adapter (not the parameter wrappers)."""
    from peft.tuners.lora.layer import ParamWrapper

    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and not isinstance(m, ParamWrapper)
        }
    )


def wrapped_parameters(peft_model) -> list[tuple[str, str]]:
    """(target parameter, layout) of every adapted parameter (peft's ParamWrapper), innermost wrapper
    first on each module: the order of the published `target_parameters` (`weights.adapter`).
    layout: '[experts, out, in]', '[experts, in, out]' (the class sets is_transposed: gpt-oss) or
    '[out, in]' (a 2D weight)."""
    from peft.tuners.lora.layer import ParamWrapper

    targets = peft_model.peft_config[peft_model.active_adapter].target_parameters or []
    found = []
    for name, m in peft_model.named_modules():
        if isinstance(m, ParamWrapper):
            module = name.replace(".base_layer", "")
            target = next(t for t in targets if f"{module}.{m.parameter_name}".endswith(f".{t}"))
            depth = name.count(".base_layer")
            found.append((module, -depth, target, _layout(m)))
    ordered = [(t, layout) for _, _, t, layout in sorted(found, key=lambda f: (f[0], f[1]))]
    return list(dict.fromkeys(ordered))


def _layout(wrapper) -> str:
    if wrapper.get_param().dim() == 2:
        return "[out, in]"
    return "[experts, in, out]" if getattr(wrapper.get_base_layer(), "is_transposed", False) else "[experts, out, in]"


def with_lora(model, train_cfg, distributed: bool = False) -> tuple[Any, bool]:
    """(model in train mode, whether it is LoRA): wrapped with LoRA when `train_cfg.lora_rank` > 0
    (r, alpha from the config; only the adapter trains, and AdamW keeps no state for the frozen
    base), else as is."""
    if train_cfg.lora_rank <= 0:
        return model.train(), False
    if distributed:
        raise ValueError("train.lora_rank > 0 runs on one trainer process (world size 1)")
    peft_model = apply_lora(
        model, r=train_cfg.lora_rank, alpha=train_cfg.lora_alpha, target_modules=train_cfg.lora_target_modules
    )
    return peft_model.train(), True


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapter tensors only, with peft's saved key names (adapter name removed)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}


def adapter_files(model) -> dict[str, bytes]:
    """Adapter-only publication: safetensors bytes of the adapter and its peft config JSON, which
    names what was adapted: `target_modules` (sorted), `target_parameters` (innermost wrapper first,
    `wrapped_parameters`), `fan_in_fan_out` (Conv1D weights) and, beyond peft's keys, each target
    parameter's layout (`parameter_layouts`), which the consumers' merge reads (`weights.adapter`)."""
    pcfg = model.peft_config[model.active_adapter]
    wrapped = wrapped_parameters(model)
    check_nesting(model, [t for t, _ in wrapped])
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": pcfg.r,
        "lora_alpha": pcfg.lora_alpha,
        "lora_dropout": pcfg.lora_dropout,
        "use_rslora": pcfg.use_rslora,
        "target_modules": sorted(pcfg.target_modules or []),
        "target_parameters": [t for t, _ in wrapped] or None,
        "fan_in_fan_out": bool(pcfg.fan_in_fan_out),
        "bias": "none",
        "base_model_name_or_path": pcfg.base_model_name_or_path,
        "parameter_layouts": dict(wrapped),
    }
    weights = st_save(adapter_state_dict(model), metadata={"format": "pt"})
    return {ADAPTER_WEIGHTS: weights, ADAPTER_CONFIG: json.dumps(cfg, indent=2).encode()}


def check_nesting(model, order: list[str]) -> None:
    """ValueError unless the rule the consumers read parameter adapters by (`weights.adapter.
    adapter_target`: `order` innermost first) names the parameter each of `model`'s wrappers adapts."""
    from peft.tuners.lora.layer import ParamWrapper

    for name, m in model.named_modules():
        if isinstance(m, ParamWrapper):
            key = name.removeprefix("base_model.model.")
            got = adapter_target(key, order, fan_in_fan_out=False)[0]
            if got != f"{key.replace('.base_layer', '')}.{m.parameter_name}":
                raise ValueError(f"LoRA wrapper {name} adapts {m.parameter_name}, the published order says {got}")


@torch.no_grad()
def merge_adapter(base_model, files: dict[str, bytes]) -> int:
    """Merge published adapter files into a plain (non-peft) model in place: W += scale · B @ A.

    Returns the number of weight matrices updated. Call it on a model holding the base weights
    (merging twice adds the delta twice)."""
    params = dict(base_model.named_parameters())
    merged = merged_weights(params, files)
    for name, w in merged.items():
        params[name].copy_(w)
    return len(merged)


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Full weights with the adapters folded in, base-model key names, without changing `model`
    (for consumers that need a whole checkpoint)."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    return {k: v.detach().contiguous().cpu() for k, v in merged.state_dict().items()}


def set_gradient_checkpointing(model, enabled: bool) -> None:
    """Turn activation checkpointing on/off (non-reentrant, so frozen inputs under LoRA are fine)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
        if enabled:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.activation_checkpointing_disable()
    elif enabled:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_disable()
    if enabled:
        base.config.use_cache = False


def is_gradient_checkpointing(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
