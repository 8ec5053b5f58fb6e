"""HF ⇄ Megatron state dicts for the Qwen2 and Llama families, unsharded (TP = 1); pure torch.

Megatron-core's layout (megatron/core/transformer/attention.py `get_query_key_value_tensors`,
megatron/core/transformer/mlp.py `glu`, both read at 0.16.1):

* `linear_qkv` fuses q, k and v per query group: the rows are, for each of the `num_kv_heads`
  groups g in order, the group's `num_heads / num_kv_heads` query heads, then k_g, then v_g
  (`[q_g..., k_g, v_g]`, each head `kv_channels` rows); the bias (Qwen2) likewise;
* `linear_fc1` is `[gate; up]` (the forward chunks it in two: silu(first) * second);
* `linear_proj` is o_proj, `linear_fc2` is down_proj; the embedding and output layer are as HF's;
  with tied embeddings (`share_embeddings_and_output_weights`) there is no `output_layer.weight`.

Key names are those of the local (pure PyTorch) layer spec (`get_gpt_layer_local_spec`):
`input_layernorm` / `pre_mlp_layernorm` modules. `te_layout=True` gives the Transformer Engine
spec's names, where the norms live in the fused linear layers (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`). Every tensor is copied or moved, never changed: HF → Megatron →
HF is byte-exact (tests/test_megatron_convert.py).
"""

from __future__ import annotations

import torch

from areal_core.megatron.shapes import ModelShape

# layers copied as they are: (HF name, Megatron name), weight and bias
_PLAIN = (("self_attn.o_proj", "self_attention.linear_proj"), ("mlp.down_proj", "mlp.linear_fc2"))


def _norm_names(te_layout: bool) -> tuple[str, str]:
    if te_layout:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def pad_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padded vocabulary: a multiple of divisible_by x tensor_parallel."""
    step = divisible_by * tensor_parallel
    return -(-vocab_size // step) * step


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) → Megatron's linear_qkv."""
    groups, d = shape.num_kv_heads, shape.kv_channels
    per = shape.num_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest))
    return torch.cat(parts, dim=1).reshape(groups * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's linear_qkv (weight or bias, unsharded) → HF (q, k, v)."""
    groups, d = shape.num_kv_heads, shape.kv_channels
    per = shape.num_heads // groups
    rest = qkv.shape[1:]
    if qkv.shape[0] != groups * (per + 2) * d:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, the shape needs {groups * (per + 2) * d}")
    q, k, v = torch.split(qkv.reshape(groups, (per + 2) * d, *rest), [per * d, d, d], dim=1)
    return (
        q.reshape(groups * per * d, *rest).contiguous(),
        k.reshape(groups * d, *rest).contiguous(),
        v.reshape(groups * d, *rest).contiguous(),
    )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the model's {t.shape[0]}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    shape: ModelShape,
    padded_vocab_size: int | None = None,
    te_layout: bool = False,
) -> dict[str, torch.Tensor]:
    """An HF Qwen2/Llama causal-LM state dict → Megatron GPTModel's (TP = 1). Every key must be
    used: an unknown one (another architecture) raises ValueError, naming it."""
    left = dict(hf)
    attn_norm, mlp_norm = _norm_names(te_layout)
    rows = padded_vocab_size or shape.vocab_size
    embed = left.pop("model.embed_tokens.weight")
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": _pad_rows(embed, rows)}
    lm_head = left.pop("lm_head.weight", None)
    if shape.tie_word_embeddings:
        if lm_head is not None and not torch.equal(lm_head, embed):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
    elif lm_head is None:
        raise ValueError("untied embeddings but the state dict has no lm_head.weight")
    else:
        out["output_layer.weight"] = _pad_rows(lm_head, rows)
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + attn_norm] = left.pop(h + "input_layernorm.weight")
        out[m + mlp_norm] = left.pop(h + "post_attention_layernorm.weight")
        qkv = [left.pop(f"{h}self_attn.{p}_proj.weight") for p in "qkv"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv, shape)
        if h + "self_attn.q_proj.bias" in left:
            qkv = [left.pop(f"{h}self_attn.{p}_proj.bias") for p in "qkv"]
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(*qkv, shape)
        for hf_name, mg_name in _PLAIN:
            for kind in ("weight", "bias"):
                if f"{h}{hf_name}.{kind}" in left:
                    out[f"{m}{mg_name}.{kind}"] = left.pop(f"{h}{hf_name}.{kind}")
        for kind in ("weight", "bias"):
            if f"{h}mlp.gate_proj.{kind}" in left:
                gate, up = left.pop(f"{h}mlp.gate_proj.{kind}"), left.pop(f"{h}mlp.up_proj.{kind}")
                out[f"{m}mlp.linear_fc1.{kind}"] = torch.cat([gate, up])
    out["decoder.final_layernorm.weight"] = left.pop("model.norm.weight")
    if left:
        raise ValueError(f"HF keys this converter does not know (not a Qwen2/Llama model?): {sorted(left)[:8]}")
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: ModelShape, te_layout: bool = False) -> dict[str, torch.Tensor]:
    """Megatron GPTModel's state dict (TP = 1; `shard.unshard_state_dict` first) → HF's. The padded
    vocabulary rows are dropped; with tied embeddings there is no lm_head.weight (as in an HF
    safetensors file). `_extra_state` entries (Transformer Engine's fp8 metadata) are ignored."""
    left = {k: v for k, v in mg.items() if not k.endswith("._extra_state")}
    attn_norm, mlp_norm = _norm_names(te_layout)
    out = {"model.embed_tokens.weight": left.pop("embedding.word_embeddings.weight")[: shape.vocab_size]}
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = left.pop(m + attn_norm)
        out[h + "post_attention_layernorm.weight"] = left.pop(m + mlp_norm)
        for kind in ("weight", "bias"):
            if f"{m}self_attention.linear_qkv.{kind}" in left:
                q, k, v = split_qkv(left.pop(f"{m}self_attention.linear_qkv.{kind}"), shape)
                out.update({f"{h}self_attn.q_proj.{kind}": q, f"{h}self_attn.k_proj.{kind}": k})
                out[f"{h}self_attn.v_proj.{kind}"] = v
            if f"{m}mlp.linear_fc1.{kind}" in left:
                gate, up = left.pop(f"{m}mlp.linear_fc1.{kind}").chunk(2)
                out[f"{h}mlp.gate_proj.{kind}"], out[f"{h}mlp.up_proj.{kind}"] = gate.contiguous(), up.contiguous()
            for hf_name, mg_name in _PLAIN:
                if f"{m}{mg_name}.{kind}" in left:
                    out[f"{h}{hf_name}.{kind}"] = left.pop(f"{m}{mg_name}.{kind}")
    out["model.norm.weight"] = left.pop("decoder.final_layernorm.weight")
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = left.pop("output_layer.weight")[: shape.vocab_size]
    if left:
        raise ValueError(f"Megatron keys this converter does not know: {sorted(left)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}
