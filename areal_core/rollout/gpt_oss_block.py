"""gpt-oss (transformers' `GptOssForCausalLM`) pieces of the continuous engine's decoder
(`static_cache.py`): attention with sinks and the sparse MLP, read from the model's own weights.

Attention sinks: each query head h has a learned logit s_h that joins the softmax's denominator
and attends to nothing (transformers' `eager_attention_forward` for gpt-oss):

    p_j = exp(S_j) / (Σ_i exp(S_i) + exp(s_h)),   O = Σ_j p_j · V_j     S = q·Kᵀ/√d + M (mask)

The sparse MLP, for the tokens x_t of a pass (`GptOssTopKRouter`, `GptOssExperts`):

    E_t, l_t = the top-k experts of W_r · x_t + b_r and their logits;   w_t = softmax(l_t)
    [g | u]  = W_gu[e]ᵀ · x_t + b_gu[e]   (gate and up interleaved: g = even, u = odd columns)
    y_t      = Σ_{e ∈ E_t} w_{t,e} · (W_d[e]ᵀ · ((min(u, L)∨−L + 1) ⊙ g' ⊙ σ(α·g')) + b_d[e]),   g' = min(g, L)

The k·T (token, expert) pairs run grouped by expert, one grouped GEMM per weight for all rows
(`moe_block.grouped_linear`), as the Qwen-MoE blocks do. RoPE (YaRN) is the model's own
rotary_emb table, which `static_cache` reads whatever the rope type; the alternating windows are
`architecture.attention_windows` of `config.layer_types`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_core.rollout.moe_block import expert_order, grouped_linear


@dataclass
class GptOssMoe:
    """One gpt-oss sparse block, views of the model's parameters: router `weight` [E, hidden] and
    `bias` [E]; `gate_up` [E, hidden, 2I] (gate/up interleaved) and `gate_up_bias` [E, 2I];
    `down` [E, I, hidden] and `down_bias` [E, hidden]; the clamped SwiGLU's `alpha` and `limit`."""

    layer: int
    weight: torch.Tensor
    bias: torch.Tensor
    top_k: int
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float
    shared_gate_up: None = None  # no shared expert (static_cache's refresh asks)


def is_gpt_oss_mlp(mlp: torch.nn.Module) -> bool:
    return type(mlp).__name__ == "GptOssMLP"


def read_gpt_oss(mlp: torch.nn.Module, layer: int) -> GptOssMoe | None:
    """Layer `layer`'s GptOssMLP as a GptOssMoe (views, no copies); None for any other MLP."""
    if not is_gpt_oss_mlp(mlp):
        return None
    r, e = mlp.router, mlp.experts
    return GptOssMoe(
        layer=layer,
        weight=r.weight,
        bias=r.bias,
        top_k=int(r.top_k),
        gate_up=e.gate_up_proj,
        gate_up_bias=e.gate_up_proj_bias,
        down=e.down_proj,
        down_bias=e.down_proj_bias,
        alpha=float(e.alpha),
        limit=float(e.limit),
    )


def unsupported_gpt_oss(model: torch.nn.Module) -> str | None:
    """What this module would compute differently from a gpt-oss model's layers (None: nothing)."""
    for i, blk in enumerate(model.model.layers):
        if getattr(blk.self_attn, "sinks", None) is None:
            return f"layer {i}'s attention has no sinks"
        if not is_gpt_oss_mlp(blk.mlp):
            return f"layer {i}'s MLP is a {type(blk.mlp).__name__}, not a GptOssMLP"
        e = blk.mlp.experts
        layout = (getattr(e, "is_transposed", None), getattr(e, "is_concatenated", None), getattr(e, "has_bias", None))
        if layout != (True, False, True) or e.gate_up_proj.dim() != 3:
            return f"layer {i}'s experts are not [E, hidden, 2I] interleaved gate/up, [E, I, hidden] down, with biases"
    return None


def route(hidden: torch.Tensor, block: GptOssMoe) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k]): the k largest router logits W_r·h + b_r and the
    softmax over those k, in hidden's dtype (transformers' GptOssTopKRouter)."""
    logits = F.linear(hidden, block.weight, block.bias)
    top, ids = torch.topk(logits, block.top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=top.dtype)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(clamp(u, −L, L) + 1) ⊙ g·σ(α·g), g = min(gate, L); gate and up interleaved in the last dim
    (transformers' GptOssExperts._apply_gate)."""
    gate = gate_up[..., ::2].clamp(min=None, max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_mlp_into(
    block: GptOssMoe, x: torch.Tensor, normed: torch.Tensor, on_route: Callable[[int, torch.Tensor], None] | None = None
) -> torch.Tensor:
    """x + y (module docstring) for `normed` = n(x) [T, hidden]; `on_route(layer, topk_ids)` is told
    the experts chosen. The pairs sorted by expert: one grouped GEMM per weight over all tokens."""
    ids, weights = route(normed, block)
    if on_route is not None:
        on_route(block.layer, ids)
    by_expert, order, token, offs = expert_order(ids, block.gate_up.shape[0])
    h = grouped_linear(normed.index_select(0, token), block.gate_up.transpose(1, 2), offs)
    h += block.gate_up_bias.index_select(0, by_expert)
    y = grouped_linear(clamped_swiglu(h, block.alpha, block.limit), block.down.transpose(1, 2), offs)
    y += block.down_bias.index_select(0, by_expert)
    y.mul_(weights.reshape(-1).index_select(0, order)[:, None])
    return x.clone().index_add_(0, token, y)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention with sinks over `q` [r, H, P, d], `k`/`v` [r, KVH, P, d] where `allowed` [P, P]
    says which keys a query sees: one extra key of zeros (score q·0 = 0) and value zero, whose
    mask entry for head h is s_h, adds exp(s_h) to the denominator and nothing to the output."""
    r, kvh, P, d = k.shape
    zero = k.new_zeros(r, kvh, 1, d)
    mask = torch.zeros(P, P, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    sink = sinks.to(q.dtype).view(-1, 1, 1).expand(-1, P, 1)
    mask = torch.cat([mask.expand(sink.shape[0], P, P), sink], dim=-1)[None]  # [1, H, P, P + 1]
    return F.scaled_dot_product_attention(
        q, torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2), attn_mask=mask, scale=scale, enable_gqa=True
    )
