"""megatron-core backend for large models on GPU: tensor (TP), pipeline (PP) and context (CP)
parallel training; data parallel over the remaining ranks.

UNVERIFIED HERE. The development machine has no GPU and megatron-core is not installed, so this
module holds only what can be checked without them:

* `check_megatron_config`: the shape constraints megatron-core enforces at start-up (TP divides
  heads, KV groups, hidden and FFN sizes; PP divides layers; TP·PP·CP divides the world size;
  the global batch splits into micro-batches over the data-parallel ranks), so that a bad
  combination fails at `prepare` (one line naming the key) instead of minutes into a GPU job;
* `transformer_config_kwargs`: the keyword arguments of `megatron.core.transformer.TransformerConfig`
  for the run's model;
* `import_megatron`: a clear error where megatron-core is missing.

What a GPU smoke run must still establish (docs/cluster.md): building the GPTModel from an HF
Qwen2 checkpoint (weight conversion), the decoupled-PPO loss under PP (the loss on the last
stage, log-probs gathered across TP ranks of the vocabulary-parallel output layer), and weight
publication from the TP/PP shards back to an HF state dict on rank 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from areal_core.config import ConfigError


@dataclass
class MegatronParallel:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    world_size: int = 1
    micro_batch_size: int = 1  # sequences per micro-batch and data-parallel rank
    virtual_pipeline: int = 1  # interleaved schedule: model chunks per pipeline rank
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.model_parallel


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


def model_shape(run_cfg: Any) -> ModelShape:
    """The shape of the run's model: the HF checkpoint's config.json when model.path is set,
    else the tiny model the config describes."""
    m = run_cfg.model
    if m.path:
        from areal_core.store import Store

        hf = json.loads(Store(m.path).read_text("config.json"))
        return ModelShape(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", m.max_position_embeddings),
        )
    return ModelShape(
        m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size,
        m.max_position_embeddings,
    )  # fmt: skip


def check_megatron_config(run_cfg: Any, par: MegatronParallel, shape: ModelShape | None = None) -> ModelShape:
    """Raise ConfigError (one line naming the setting) on a TP/PP/CP layout megatron-core rejects."""
    s = shape or model_shape(run_cfg)
    tp, pp, cp = par.tensor, par.pipeline, par.context
    for name, value in (("tensor", tp), ("pipeline", pp), ("context", cp), ("micro_batch_size", par.micro_batch_size)):
        if value < 1:
            raise ConfigError(f"megatron: {name} parallel size must be >= 1, got {value}")
    if getattr(run_cfg, "device", "cuda") != "cuda":
        raise ConfigError(f"megatron backend needs device cuda, got {run_cfg.device!r}")
    if par.world_size % par.model_parallel:
        raise ConfigError(
            f"megatron: world size {par.world_size} is not a multiple of tensor x pipeline x context = {par.model_parallel}"
        )
    if s.num_heads % tp:
        raise ConfigError(f"megatron: tensor parallel {tp} must divide model.num_heads={s.num_heads}")
    if s.num_kv_heads % tp:
        raise ConfigError(f"megatron: tensor parallel {tp} must divide model.num_kv_heads={s.num_kv_heads}")
    if s.hidden_size % tp:
        raise ConfigError(f"megatron: tensor parallel {tp} must divide model.hidden_size={s.hidden_size}")
    if s.intermediate_size % tp:
        raise ConfigError(f"megatron: tensor parallel {tp} must divide model.intermediate_size={s.intermediate_size}")
    if s.num_layers % (pp * par.virtual_pipeline):
        raise ConfigError(
            f"megatron: pipeline parallel {pp} x virtual {par.virtual_pipeline} must divide model.num_layers={s.num_layers}"
        )
    if par.virtual_pipeline > 1 and pp < 2:
        raise ConfigError("megatron: an interleaved (virtual) pipeline needs pipeline parallel >= 2")
    if par.sequence_parallel and tp < 2:
        raise ConfigError("megatron: sequence parallel needs tensor parallel >= 2")
    if cp > 1 and s.max_position_embeddings % (2 * cp):
        raise ConfigError(f"megatron: context parallel {cp} needs model.max_position_embeddings divisible by {2 * cp}")
    global_batch = run_cfg.train.batch_groups * run_cfg.rollout.group_size // run_cfg.train.ppo_minibatches
    per_step = par.micro_batch_size * par.data_parallel
    if global_batch % per_step:
        raise ConfigError(
            f"megatron: a minibatch of {global_batch} sequences (train.batch_groups x rollout.group_size / "
            f"train.ppo_minibatches) must split into micro-batches of {par.micro_batch_size} over "
            f"{par.data_parallel} data-parallel ranks"
        )
    return s


def transformer_config_kwargs(shape: ModelShape, par: MegatronParallel, bf16: bool = True) -> dict[str, Any]:
    """Keyword arguments for megatron.core.transformer.TransformerConfig (Qwen2-style: RMSNorm,
    SwiGLU, grouped-query attention with QKV bias; rotary embeddings are the GPTModel's
    position_embedding_type="rope"). Unverified here."""
    import torch

    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads,
        "ffn_hidden_size": shape.intermediate_size,
        "tensor_model_parallel_size": par.tensor,
        "pipeline_model_parallel_size": par.pipeline,
        "context_parallel_size": par.context,
        "virtual_pipeline_model_parallel_size": par.virtual_pipeline if par.virtual_pipeline > 1 else None,
        "sequence_parallel": par.sequence_parallel,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "bf16": bf16,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
    }


def import_megatron():
    """megatron.core, or an ImportError that says which image has it."""
    try:
        import megatron.core as mcore  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(
            "the megatron backend needs megatron-core (installed in the cuda image, images/specs.py); "
            "it is not installed in this environment"
        ) from exc
    return mcore
