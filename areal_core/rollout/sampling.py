"""Batched sampling with per-row settings and per-request, counter-based randomness.

Each row r has a temperature τ_r, top-k k_r (0: off), top-p p_r (1: off), a greedy flag, and
one uniform number per sampled token, a pure function of the request seed and the index t of
the token being sampled (h is a 32-bit integer hash, "lowbias32"):

    u_r = (h(h(seed_r) + t·φ) >> 8 + ½) / 2²⁴ ∈ (0, 1)
    token_r = min{ j : C_r(j) ≥ u_r · C_r(V−1) },   C_r(j) = Σ_{i ≤ j} π̃_r(i)   (inverse CDF)

where π̃_r is softmax(logits/τ_r) restricted to the top-k ∩ top-p set (taken in descending
order when a filter is on). This is an exact draw from π̃_r, and it does not depend on which
slot the request sits in, what else is in the batch, or whether the request was re-prefilled
after a weight swap. The behaviour log-prob returned is log softmax(logits/τ_r) at the token,
before top-k/top-p filtering (what the trainer recomputes); greedy rows use τ = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_PHI = 0x9E3779B9 - (1 << 32)  # golden-ratio increment as a signed int32
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors (logical shifts emulated by masking)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2
    return x ^ ((x >> 16) & 0xFFFF)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """κ_r = h(h(seed_r) + t_r) as int32 from int64 seeds and counters [n]."""
    s = (seeds & 0x7FFFFFFF).to(torch.int32) ^ ((seeds >> 31) & 0x7FFFFFFF).to(torch.int32)
    return _hash32(_hash32(s) + counters.to(torch.int32) * _PHI)


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """u ∈ (0, 1) (float64) from row keys [n] (int32): 24 random bits, centred in their bin."""
    bits = (_hash32(keys) >> 8) & 0xFFFFFF
    return (bits.double() + 0.5) * (1.0 / (1 << 24))


@dataclass
class RowParams:
    """Per-row sampling settings as device tensors (rebuilt when the set of rows changes)."""

    temperature: torch.Tensor  # [n] float; 1 for greedy rows
    top_k: torch.Tensor  # [n] long; vocab size where off
    top_p: torch.Tensor  # [n] float
    greedy: torch.Tensor  # [n] bool
    seeds: torch.Tensor  # [n] int64
    all_greedy: bool
    any_greedy: bool
    any_filter: bool


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j with C(j−1) < u·C(V−1) ≤ C(j) per row of `probs` [n, V] (cumsum in float64)."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, rp: RowParams, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [n], behaviour log-probs [n]) for last-position logits [n, V]."""
    logits = logits.float()
    if rp.all_greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / rp.temperature[:, None], dim=-1)
    u = uniforms(row_keys(rp.seeds, counters))
    if rp.any_filter:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        keep = ranks[None, :] < rp.top_k[:, None]
        p = torch.softmax(sorted_lp.masked_fill(~keep, float("-inf")), dim=-1)
        keep &= (p.cumsum(-1) - p) <= rp.top_p[:, None]
        idx = _inverse_cdf(p.masked_fill(~keep, 0.0), u)
        tok = order.gather(-1, idx[:, None]).squeeze(-1)
    else:
        tok = _inverse_cdf(logp.exp(), u)
    if rp.any_greedy:
        tok = torch.where(rp.greedy, logits.argmax(-1), tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
