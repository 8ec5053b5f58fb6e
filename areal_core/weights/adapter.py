"""LoRA adapter versions: what a LoRA run publishes, and how a consumer turns it into weights.

A LoRA run publishes weights/v{N}/ as peft's on-disk pair (`adapter_model.safetensors`,
`adapter_config.json`, a few MB) instead of the model; the base it applies to is the run's
`init_model/` (the model the trainer wrapped). A consumer folds it into the base weights:

    W = W_base + s · B @ A,    s = alpha / r   (alpha / √r with rsLoRA)

for every adapted linear layer (A: [r, in], B: [out, r]). Only the adapted weights change, so a
consumer that holds the base model loads just those (`merged_weights`), and a server that loads a
whole checkpoint gets base + merged (`reader.stage_verified`). Merging is always from the base,
never on top of a previous version: loading versions in any order gives the same weights.
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


def adapted_modules(files: dict[str, bytes]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base module name: (A, B)} of a published adapter (peft key names, e.g.
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> 'model.layers.0.self_attn.q_proj')."""
    tensors = st_load(files[ADAPTER_WEIGHTS])
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"adapter holds {key} without its lora_B")
        out[key.split(".lora_A.")[0].removeprefix("base_model.model.")] = (a, b)
    return out


@torch.no_grad()
def merged_weights(base: dict[str, torch.Tensor], files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """{'<module>.weight': W_base + s·B@A} for every adapted module (new tensors; `base` unchanged).
    `base` holds at least the adapted modules' weights. ValueError names a module the base lacks."""
    scale = lora_scale(json.loads(files[ADAPTER_CONFIG]))
    out = {}
    for module, (a, b) in adapted_modules(files).items():
        name = f"{module}.weight"
        w = base.get(name)
        if w is None:
            raise ValueError(f"adapter names {module!r}, which the base model does not have")
        if w.shape != (b.shape[0], a.shape[1]):
            raise ValueError(
                f"adapter for {module!r} has shape {tuple(b.shape)}@{tuple(a.shape)}, base {tuple(w.shape)}"
            )
        out[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
