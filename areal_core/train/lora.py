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

from areal_core.architecture import UnsupportedArchitecture, resolve_lora_targets
from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merged_weights


def apply_lora(
    model,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: str | tuple[str, ...] = "",
    rslora: bool = False,
):
    """Wrap a causal LM with LoRA adapters; only the adapters are trainable. Returns the PeftModel.

    `target_modules`: last names of the linear layers to adapt (a tuple, or comma-separated as
    `train.lora_target_modules` gives them); empty: every attention and MLP projection of the
    architecture (`architecture.resolve_lora_targets`). UnsupportedArchitecture when a name
    matches no layer, or when a resolved name ends up without an adapter."""
    from peft import LoraConfig, get_peft_model

    requested = target_modules if isinstance(target_modules, str) else ",".join(target_modules)
    targets = resolve_lora_targets(model, requested)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    missing = sorted(set(targets) - set(adapted_names(peft_model)))
    if missing:
        raise UnsupportedArchitecture(f"LoRA targets {missing} got no adapter in {type(model).__name__}")
    return peft_model


def adapted_names(peft_model) -> list[str]:
    """Sorted last names of the modules that carry a LoRA adapter."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")})


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
    """Adapter-only publication: safetensors bytes of the adapter and its peft config JSON."""
    pcfg = model.peft_config[model.active_adapter]
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": pcfg.r,
        "lora_alpha": pcfg.lora_alpha,
        "lora_dropout": pcfg.lora_dropout,
        "use_rslora": pcfg.use_rslora,
        "target_modules": sorted(pcfg.target_modules),
        "bias": "none",
        "base_model_name_or_path": pcfg.base_model_name_or_path,
    }
    weights = st_save(adapter_state_dict(model), metadata={"format": "pt"})
    return {ADAPTER_WEIGHTS: weights, ADAPTER_CONFIG: json.dumps(cfg, indent=2).encode()}


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
