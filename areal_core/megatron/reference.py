"""A pure-torch forward of Megatron-layout TP shards: what megatron-core's GPTModel computes on
TP ranks, written out so that it runs on CPU without megatron-core (whose forward needs CUDA,
docs/megatron.md). Its logits equal the HF model's (tests/test_megatron_convert.py), which checks
the conversion's meaning and not only its round trip: a QKV fusing that split the heads in
another order, or fc1 shards that were not `[gate_r; up_r]`, would round-trip byte-exact and
still compute something else.

Each rank's part follows megatron-core: the vocabulary-parallel embedding looks up only the ids
in its vocabulary range (the partial sums are all-reduced: summed here); `linear_qkv`'s output is
viewed as [..., groups on the rank, (heads per group + 2) * kv_channels] and split into q, k, v
(attention.py `get_query_key_value_tensors`); row-parallel `linear_proj` and `linear_fc2` give
partial sums; the output layer's vocabulary parts are concatenated. Causal attention, no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_core.megatron.shapes import ModelShape


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # non-interleaved (HF rotate_half)
    return x * cos + rotated * sin


def _attention(
    sd: dict[str, torch.Tensor], p: str, x: torch.Tensor, shape: ModelShape, tp: int, rope: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    groups, d = shape.num_kv_heads // tp, shape.kv_channels
    per = shape.num_heads // shape.num_kv_heads
    mixed = F.linear(x, sd[p + "linear_qkv.weight"], sd.get(p + "linear_qkv.bias"))
    b, s = x.shape[:2]
    q, k, v = torch.split(mixed.view(b, s, groups, (per + 2) * d), [per * d, d, d], dim=3)
    q = q.reshape(b, s, groups * per, d).transpose(1, 2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    q, k = _rope(q, *rope), _rope(k, *rope)
    k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(b, s, groups * per * d), sd[p + "linear_proj.weight"])


def _mlp(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, sd[p + "linear_fc1.weight"], sd.get(p + "linear_fc1.bias")).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, sd[p + "linear_fc2.weight"])


def _embed(shards: list[dict[str, torch.Tensor]], ids: torch.Tensor) -> torch.Tensor:
    total = None
    start = 0
    for sd in shards:
        table = sd["embedding.word_embeddings.weight"]
        inside = (ids >= start) & (ids < start + table.shape[0])
        part = F.embedding((ids - start).clamp(0, table.shape[0] - 1), table) * inside.unsqueeze(-1)
        total = part if total is None else total + part
        start += table.shape[0]
    assert total is not None
    return total


def reference_logits(shards: list[dict[str, torch.Tensor]], shape: ModelShape, ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of the Megatron-layout TP shards (local spec names) on `ids`."""
    tp, eps, d = len(shards), shape.rms_norm_eps, shape.kv_channels
    first = shards[0]
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    h = _embed(shards, ids)
    rope = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        x = _rms(h, first[p + "input_layernorm.weight"], eps)
        h = h + sum(_attention(sd, p + "self_attention.", x, shape, tp, rope) for sd in shards)
        if p + "self_attention.linear_proj.bias" in first:
            h = h + first[p + "self_attention.linear_proj.bias"]
        x = _rms(h, first[p + "pre_mlp_layernorm.weight"], eps)
        h = h + sum(_mlp(sd, p + "mlp.", x) for sd in shards)
        if p + "mlp.linear_fc2.bias" in first:
            h = h + first[p + "mlp.linear_fc2.bias"]
    h = _rms(h, first["decoder.final_layernorm.weight"], eps)
    out_key = "embedding.word_embeddings.weight" if shape.tie_word_embeddings else "output_layer.weight"
    return torch.cat([F.linear(h, sd[out_key]) for sd in shards], dim=-1)[..., : shape.vocab_size]
