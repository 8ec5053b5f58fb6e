"""What both static-cache decoders (`static_cache.StaticCacheDecoder`, `mla_decoder.MlaCacheDecoder`) do with a
cache: one decode step's attention over the cached keys, and moving slots when sequences finish."""

from __future__ import annotations

import torch


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """p_j = exp(S_j) / (Σ_i exp(S_i) + exp(s_h)) over the last dim of `scores` [n·KVH, G, keys]
    (query head h = kv head · G + g, as transformers' repeat_kv orders them); plain softmax when
    `sinks` is None (gpt-oss's attention sinks: `gpt_oss_block`)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    G = scores.shape[1]
    grouped = scores.unflatten(0, (-1, sinks.shape[0] // G))  # [n, KVH, G, keys]
    sink = sinks.to(scores.dtype).view(1, -1, G, 1).expand(grouped.shape[0], -1, -1, 1)
    return torch.softmax(torch.cat([grouped, sink], dim=-1), dim=-1)[..., :-1].flatten(0, 1)


def cached_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """O = softmax(α·q·Kᵀ + M)·V as two batched matmuls: `q` [b, G, d] (the G query heads sharing one
    kv head as the rows of one small matrix), `keys` [b, span, d], `vals` [b, span, d_v], `bias` M
    [b, 1, span] (0 where a key is visible, −∞ where not); with `sinks`, the softmax's denominator
    also holds each head's sink (`sink_softmax`). Returns [b, G, d_v]."""
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
    return torch.bmm(sink_softmax(scores, sinks), vals)


@torch.no_grad()
def move_slots(caches: list[torch.Tensor], src: list[int], dst: list[int], span: int, slot_dim: int) -> None:
    """Copy cache slots src → dst (positions < span, the next-to-last dim) in every cache, whose slots
    run along `slot_dim`: compaction after sequences finish."""
    if not src:
        return
    s = torch.tensor(src, device=caches[0].device)
    d = torch.tensor(dst, device=caches[0].device)
    for cache in caches:
        rows = cache.narrow(-2, 0, span)
        rows.index_copy_(slot_dim, d, rows.index_select(slot_dim, s))
