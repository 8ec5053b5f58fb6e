"""megatron-core's GPTModel for a Qwen2/Llama shape, with the local (pure PyTorch) layer spec,
and a converted state dict loaded into it. Needs megatron-core (`pip install '.[megatron]'`, or the
megatron venv of scripts/setup_megatron_venv.sh) and an initialized
`megatron.core.parallel_state` (torch.distributed up, `initialize_model_parallel` called).

On CPU (megatron-core 0.16.1, torch 2.13.0+cpu, gloo) construction works at TP 1 and TP 2 and
the state dicts match `convert.py` / `shard.py` key for key and shape for shape; the forward
stops at the first CUDA call (docs/megatron.md names it).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from areal_core.megatron.shapes import MegatronParallel, ModelShape, gpt_model_kwargs, transformer_config_kwargs


def build_gpt_model(
    shape: ModelShape,
    tensor_parallel: int = 1,
    padded_vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    cpu_init: bool = True,
) -> Any:
    """A GPTModel (local spec, no dropout) on this rank's TP part; parallel_state must be initialized."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kw = transformer_config_kwargs(shape, MegatronParallel(tensor=tensor_parallel), bf16=dtype == torch.bfloat16)
    kw.update(params_dtype=dtype, use_cpu_initialization=cpu_init, hidden_dropout=0.0, attention_dropout=0.0)
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, **gpt_model_kwargs(shape, padded_vocab_size))


def state_dict_mismatches(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> list[str]:
    """How `sd` differs from the model's own state dict (`_extra_state` aside): missing and
    unexpected keys, and shapes; empty when it fits key for key."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    out = [f"missing {k}" for k in sorted(set(own) - set(sd))]
    out += [f"unexpected {k}" for k in sorted(set(sd) - set(own))]
    out += [
        f"{k}: model {tuple(own[k].shape)}, converted {tuple(sd[k].shape)}"
        for k in sorted(set(own) & set(sd))
        if own[k].shape != sd[k].shape
    ]
    return out


def load_converted(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load a converted (and sharded) state dict; raises ValueError naming what does not fit."""
    bad = state_dict_mismatches(model, sd)
    if bad:
        raise ValueError(f"the converted state dict does not fit the GPTModel: {bad[:8]}")
    model.load_state_dict(sd, strict=False)  # strict=False only for the `_extra_state` entries


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's attention mask convention: [1, 1, s, s], True where attention is masked out."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def try_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, str] | None]:
    """(logits [b, s, vocab part], None), or (None, where it stopped): the innermost megatron-core
    frame ("megatron/core/...py:LINE in FUNC"), the line of code and the error."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    try:
        with torch.no_grad():
            return model(ids, positions, attention_mask=causal_mask(ids.shape[1])), None
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden: the report names the call
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
        last = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        where = last.filename[last.filename.rfind("megatron/core/") :] if frames else last.filename
        return None, {
            "where": f"{where}:{last.lineno} in {last.name}",
            "code": (last.line or "").strip(),
            "error": f"{type(exc).__name__}: {exc}",
        }
