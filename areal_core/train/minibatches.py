"""A step's minibatches (areal_core/train/step.py): minibatch M = the groups g with g mod n_mb = mb;
each rank keeps a contiguous block of whole groups of M, its loss aggregated with M's denominators
(tokens, sequences, and Dr.GRPO's constant = M's longest response when not configured); after the
backward of every micro-batch, one clipped optimizer step and M's metrics over every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.batch import TrainBatch
from areal_core.train.distributed import DistContext, clip_grad_norm
from areal_core.train.micro_batches import SUMMED, combine
from areal_core.train.value_head import Critic


@dataclass
class Minibatch:
    """This rank's rows of one minibatch and the minibatch's denominators (over every rank)."""

    rows: torch.Tensor  # row indices into the batch
    members: torch.Tensor  # the minibatch's rows on every rank
    dummy: bool  # no group of this minibatch is this rank's: one masked row keeps collectives aligned
    global_tokens: float
    global_seqs: float
    max_row_tokens: float


def rank_groups(groups: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of `groups` (group indices), possibly empty."""
    return torch.tensor_split(groups, world)[rank]


def plan_minibatches(batch: TrainBatch, n_mb: int, rank: int, world: int) -> list[Minibatch]:
    """Minibatch mb holds the groups g with g mod n_mb = mb; this rank's share of each."""
    plan = []
    for mb in range(n_mb):
        in_mb = (batch.group_index % n_mb) == mb
        groups = torch.unique(batch.group_index[in_mb])
        rows = torch.nonzero(torch.isin(batch.group_index, rank_groups(groups, rank, world)) & in_mb).flatten()
        dummy = len(rows) == 0
        if dummy:
            rows = torch.nonzero(in_mb).flatten()[:1]
        per_row = batch.loss_mask[in_mb].sum(1)
        plan.append(
            Minibatch(
                rows,
                torch.nonzero(in_mb).flatten(),
                dummy,
                global_tokens=float(per_row.sum().clamp(min=1)),
                global_seqs=float((per_row > 0).sum().clamp(min=1)),
                max_row_tokens=float(per_row.max().clamp(min=1)),
            )
        )
    return plan


def minibatch_algo(algo: AlgorithmConfig, mb: Minibatch) -> AlgorithmConfig:
    """Dr.GRPO's constant C, when not configured, is the minibatch's longest response (in tokens)."""
    if algo.aggregation == "seq_mean_token_sum_norm" and algo.norm_const <= 0:
        return algo.model_copy(update={"norm_const": mb.max_row_tokens})
    return algo


def minibatch_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
    ctx: DistContext,
    mb: Minibatch,
    critic: Critic | None,
    parts: list[tuple[dict[str, float], float]],
    n_micro: int,
    trained_tokens: float | None = None,
) -> dict[str, float]:
    """Clip (the global norm over every shard) and step; the minibatch's metrics over every rank, each rank's
    weighted by its share of the policy tokens trained on (`trained_tokens`, over every rank: fewer than the
    minibatch's when zero-advantage rows were skipped; None: all of them).
    A NaN/inf gradient (the global norm: every rank skips alike) would poison the weights and
    AdamW's moments, and the next published version with them: the update is skipped and counted."""
    mb_stats = combine(parts)
    grad_norm = clip_grad_norm(model, grad_clip or float("inf"))
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    mb_stats["nonfinite_grad_frac"] = 0.0 if finite else 1.0
    if critic is not None:
        mb_stats["critic_grad_norm"] = critic.step()  # skipped, like the policy's, when not finite
        mb_stats["critic_nonfinite_grad_frac"] = 0.0 if math.isfinite(mb_stats["critic_grad_norm"]) else 1.0
    if ctx.distributed:
        rank_tokens = sum(t for _, t in parts)
        total = mb.global_tokens if trained_tokens is None else trained_tokens
        if trained_tokens == 0.0:  # every row skipped (on every rank alike): the inert rows the ranks ran
            total = ctx.all_reduce_sum([rank_tokens])[0]
        mb_stats = _reduce(mb_stats, rank_tokens / max(total, 1.0), ctx)
    mb_stats["grad_norm"] = grad_norm
    mb_stats["micro_batches"] = float(n_micro)
    return mb_stats


def _reduce(mb_stats: dict[str, float], share: float, ctx: DistContext) -> dict[str, float]:
    """One minibatch's metrics over every rank: the loss and counts summed, means token-weighted,
        m_M = Σ_r m_r  (loss, SUMMED counts),   m_M = Σ_r s_r · m_r  (the rest),
    with s_r = `share` = this rank's fraction of the minibatch's tokens. Collective."""
    keys = ["loss", *sorted(k for k in mb_stats if k != "loss")]
    weights = [1.0 if k == "loss" or k in SUMMED else share for k in keys]
    return dict(zip(keys, ctx.all_reduce_sum([mb_stats[k] * w for k, w in zip(keys, weights)])))
