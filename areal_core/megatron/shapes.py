"""The model's shape and the parallel layout, read from an HF config, and megatron-core's
TransformerConfig keyword arguments for them. Imports torch only (no megatron-core, no pydantic),
so the megatron venv (scripts/setup_megatron_venv.sh) can use it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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
    """A Qwen2- or Llama-family decoder: RMSNorm, SwiGLU, grouped-query attention, RoPE."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // num_heads (Megatron's kv_channels)
    tie_word_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2: q/k/v biases; Llama: attention_bias (q/k/v and o_proj)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def shape_from_hf_config(hf: Any) -> ModelShape:
    """The shape of an HF Qwen2/Llama config: a transformers config object or its config.json dict."""
    get = hf.get if isinstance(hf, dict) else lambda k, d=None: getattr(hf, k, d)
    heads = get("num_attention_heads")
    rope = get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelShape(
        num_layers=get("num_hidden_layers"),
        hidden_size=get("hidden_size"),
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        intermediate_size=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings", 2048),
        head_dim=get("head_dim") or 0,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=get("model_type") == "qwen2" or bool(get("attention_bias", False)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
    )


def transformer_config_kwargs(shape: ModelShape, par: MegatronParallel, bf16: bool = True) -> dict[str, Any]:
    """Keyword arguments for megatron.core.transformer.TransformerConfig: RMSNorm, SwiGLU,
    grouped-query attention (with Qwen2's q/k/v biases when `shape.qkv_bias`); rotary embeddings
    are the GPTModel's position_embedding_type="rope". Constructing the config and GPTModel from
    them on CPU is tested (tests/test_megatron_core.py); its forward needs CUDA (docs/megatron.md)."""
    import torch

    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads,
        "kv_channels": shape.kv_channels,
        "ffn_hidden_size": shape.intermediate_size,
        "tensor_model_parallel_size": par.tensor,
        "pipeline_model_parallel_size": par.pipeline,
        "context_parallel_size": par.context,
        "virtual_pipeline_model_parallel_size": par.virtual_pipeline if par.virtual_pipeline > 1 else None,
        "sequence_parallel": par.sequence_parallel,
        "normalization": "RMSNorm",
        "layernorm_epsilon": shape.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": shape.qkv_bias,
        "bf16": bf16,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
    }


def gpt_model_kwargs(shape: ModelShape, padded_vocab_size: int | None = None) -> dict[str, Any]:
    """Keyword arguments of megatron.core.models.gpt.GPTModel (besides config and layer spec)."""
    return {
        "vocab_size": padded_vocab_size or shape.vocab_size,
        "max_sequence_length": shape.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": int(shape.rope_theta),
        "share_embeddings_and_output_weights": shape.tie_word_embeddings,
    }
