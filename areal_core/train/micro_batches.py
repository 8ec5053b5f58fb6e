"""Micro-batches: a minibatch's rows run as forward/backward passes of at most
`train.max_tokens_per_micro_batch` tokens, their gradients accumulated before the one optimizer
step, so a step of any size fits in memory.

The split is exact for the losses that split over rows (those that run on several FSDP ranks, the
loss registry's `distributed`): each micro-batch's loss uses the minibatch's denominators (tokens,
sequences; `LossInputs.global_tokens` / `global_seqs`), so

    L_M = Σ_k L_k   and   ∇L_M = Σ_k ∇L_k

over micro-batches k. Whole groups stay together while they fit (tree packing computes a group's
prompt once per micro-batch); a group over the budget is split into runs of its rows; a row over
the budget is a micro-batch of its own.
"""

from __future__ import annotations

import torch

# per-minibatch metrics that are counts over the rows (summed over ranks and micro-batches, not averaged)
# partial sums over a micro-batch (or rank): the loss's terms are reduced with the minibatch's denominators
SUMMED = {"policy_tokens", "pref_pairs", "loss_policy", "loss_kl", "loss_distill", "loss_rl"}


def split_rows(rows: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """`rows` (row indices, whole groups contiguous as planned) cut into micro-batches of ≤ `budget`
    tokens (`lengths[row]`: the row's prompt + response tokens); `budget` ≤ 0: one micro-batch."""
    if budget <= 0 or len(rows) == 0:
        return [rows]
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    for members in _group_runs(rows.tolist(), groups[rows].tolist()):
        size = sum(int(lengths[r]) for r in members)
        if size > budget:  # the group alone is too big: runs of its rows
            for r in members:
                n = int(lengths[r])
                if current and used + n > budget:
                    out.append(current)
                    current, used = [], 0
                current.append(r)
                used += n
            continue
        if current and used + size > budget:
            out.append(current)
            current, used = [], 0
        current += members
        used += size
    if current:
        out.append(current)
    return [torch.tensor(m, dtype=rows.dtype, device=rows.device) for m in out]


def aligned(micro: list[torch.Tensor], ctx) -> list[tuple[torch.Tensor, bool]]:
    """`(rows, padding)` per micro-batch, padded on every rank to the most any rank has (FSDP's
    collectives need the same number of forward and backward passes everywhere): a padding
    micro-batch is one row whose result is discarded. Collective when distributed."""
    out = [(m, False) for m in micro]
    if ctx.distributed:
        counts = ctx.all_reduce_sum([float(len(micro)) if r == ctx.rank else 0.0 for r in range(ctx.world_size)])
        out += [(micro[0][:1], True)] * (int(max(counts)) - len(micro))
    return out


def _group_runs(rows: list[int], groups: list[int]) -> list[list[int]]:
    """Rows gathered by group, groups in order of first appearance."""
    by_group: dict[int, list[int]] = {}
    for r, g in zip(rows, groups):
        by_group.setdefault(g, []).append(r)
    return list(by_group.values())


def combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One minibatch's metrics from its micro-batches' `(metrics, policy tokens)`: the loss and counts
    summed, every other metric weighted by the micro-batch's share of the tokens (equal shares when
    no micro-batch has any)."""
    total = sum(t for _, t in parts)
    out: dict[str, float] = {}
    for stats, tokens in parts:
        share = tokens / total if total > 0 else 1.0 / len(parts)
        for k, v in stats.items():
            w = 1.0 if k == "loss" or k in SUMMED else share
            out[k] = out.get(k, 0.0) + v * w
    return out
