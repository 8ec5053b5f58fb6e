"""Attention over packed rows without an [L, L] mask: one causal SDPA call per sequence, so memory
grows with the row (O(L)), not its square (a 32k-token packed row's additive fp32 mask is 4 GB).

A packed row holds spans. A span is `(q_start, q_len, ctx_start, ctx_len)`: the queries
q_start..q_start+q_len−1 attend, causally, to the keys of a context span ctx_start..+ctx_len−1 (a
group's shared prompt in tree packing; empty for a plain sequence) followed by their own keys.
With S = [ctx; own] (n = ctx_len + q_len tokens, positions 0..n−1 within the sequence), for the
own queries i = ctx_len..n−1:

    out_i = softmax_j∈S, j ≤ i, i − j < W ( q_i·k_j · scale ) v_j          (W: the layer's window, ∞ if none)

Without a context or a binding window that is SDPA's `is_causal` (CPU's flash kernel: no mask at
all); else the queries go in blocks (of W, or `BLOCK`), each against the keys it may see under a
[block, keys] bool mask, so memory is O(block × L) and the context's own queries are never redone.
Positions not in a span (a packed row's filler) get zero outputs; nothing attends to them.

The function is registered with transformers' `AttentionInterface` as "areal_segments": with no
span plan in the forward's kwargs it is exactly "sdpa" (its mask function too), so a model switched
to it (`use_segments`) runs every other forward as before. The plan rides in the kwargs (so HF's
gradient checkpointing replays it in the backward); while a plan is active the mask function
builds no mask. Each layer's window is read from its config (areal_core/architecture.py), not from
the kwargs a model may or may not pass. Attention logit soft-capping and sinks are refused; the
first use on each model is compared with its masks (packing.py: `segments_agree`), which then
keeps a model that differs on masks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from areal_core.architecture import attention_windows

NAME = "areal_segments"
PLAN_KWARG = "areal_spans"
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("areal_spans_active", default=False)


@dataclass(frozen=True)
class SpanPlan:
    """Per packed row, its spans `(q_start, q_len, ctx_start, ctx_len)` (module docstring)."""

    rows: tuple[tuple[tuple[int, int, int, int], ...], ...]

    @staticmethod
    def from_segments(segment_ids: torch.Tensor, prefix_segment: int | None = None) -> SpanPlan:
        """Spans from a packed [R, L] segment-id map: each run of one id ≥ 0 is a sequence; with
        `prefix_segment`, a run of that id is a shared context every later sequence of its row
        attends to (tree packing); −1 is filler."""
        rows = []
        for seg in segment_ids.tolist():
            spans, start, ctx = [], 0, (0, 0)
            for i in range(1, len(seg) + 1):
                if i < len(seg) and seg[i] == seg[start]:
                    continue
                sid, n = seg[start], i - start
                if prefix_segment is not None and sid == prefix_segment:
                    spans.append((start, n, 0, 0))
                    ctx = (start, n)
                elif sid >= 0:
                    spans.append((start, n, *ctx))
                start = i
            rows.append(tuple(spans))
        return SpanPlan(tuple(rows))


BLOCK = 512  # queries per SDPA call where a mask is needed (a context before them, or a window)


def _band(q0: int, q1: int, k0: int, k1: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q1 − q0, k1 − k0] bool: query at position i sees the key at j when j ≤ i (and i − j < window)."""
    q = torch.arange(q0, q1, device=device)[:, None]
    k = torch.arange(k0, k1, device=device)[None, :]
    allowed = k <= q
    return allowed & (q - k < window) if window is not None else allowed


def _span(q, k, v, ctx: int, window: int | None, scale: float | None, dropout: float) -> torch.Tensor:
    """Attention of one span: q [1, H, n_q, D] its own queries (positions ctx..ctx+n_q−1), k, v
    [1, H, ctx + n_q, D] the context's keys then its own. Without a context or a binding window:
    SDPA's is_causal (no mask). Else queries in blocks (of the window, or BLOCK), each against the
    keys it may see, under a [block, keys] mask: memory O(block × L), never the context recomputed."""
    n = k.shape[2]
    if ctx == 0 and (window is None or window >= n):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)
    block = window if window is not None and window < n else BLOCK
    parts = []
    for lo in range(0, q.shape[2], block):
        hi = min(lo + block, q.shape[2])
        k0 = 0 if window is None else max(0, ctx + lo - window + 1)
        mask = _band(ctx + lo, ctx + hi, k0, ctx + hi, window, q.device)
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, lo:hi],
                k[:, :, k0 : ctx + hi],
                v[:, :, k0 : ctx + hi],
                attn_mask=mask,
                scale=scale,
                dropout_p=dropout,
            )
        )
    return torch.cat(parts, dim=2)


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, L, D], key/value [B, Hkv, L, D];
    returns [B, L, H, D]. With a `SpanPlan` in kwargs[PLAN_KWARG]: per span (module docstring)."""
    plan: SpanPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"segment attention does not implement {name}")
    dropout = dropout if module.training else 0.0
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = (repeat_kv(key, groups), repeat_kv(value, groups)) if groups > 1 else (key, value)
    window = attention_windows(module.config)[module.layer_idx]
    length = query.shape[2]
    rows = []
    for r, spans in enumerate(plan.rows):
        pieces, at = [], 0
        for qs, ql, cs, cl in spans:
            if qs > at:
                pieces.append(query.new_zeros(1, query.shape[1], qs - at, query.shape[3]))
            q = query[r : r + 1, :, qs : qs + ql]
            if cl:
                idx = torch.cat([torch.arange(cs, cs + cl), torch.arange(qs, qs + ql)]).to(query.device)
                k, v = key[r : r + 1].index_select(2, idx), value[r : r + 1].index_select(2, idx)
            else:
                k, v = key[r : r + 1, :, qs : qs + ql], value[r : r + 1, :, qs : qs + ql]
            pieces.append(_span(q, k, v, cl, window, scaling, dropout))
            at = qs + ql
        if at < length:
            pieces.append(query.new_zeros(1, query.shape[1], length - at, query.shape[3]))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with the attention: none while a span plan is active, else sdpa's."""
    return None if _ACTIVE.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, segment_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


@contextlib.contextmanager
def spans_active() -> Iterator[None]:
    """While set, the model's mask creation builds nothing (the plan replaces the mask)."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def base_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def use_segments(model: Any) -> bool:
    """Switch a model running "sdpa" to the span-aware attention (its plan-less forwards are sdpa's);
    False when it runs another attention (eager, flash) and stays as it is."""
    base = base_model(model)
    impl = getattr(base.config, "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl != "sdpa":
        return False
    base.set_attn_implementation(NAME)
    return True
