"""One training step with the batch's groups split across FSDP ranks.

The same maths as `areal_core.train.trainer.ppo_update` (the configured advantage estimator on
the whole batch, π_prox from the parameters before the update, the configured loss, gradient
clipping, AdamW per minibatch), made exact across ranks:

* every rank receives the full batch (rank 0 chose it) and computes the advantages on all of
  it, then keeps a contiguous block of whole groups of each minibatch (whole groups, so that
  group-level terms such as preference pairs stay on one rank);
* each rank's loss is aggregated with the denominators of the whole minibatch
  (`global_tokens`, `global_seqs`, and Dr.GRPO's constant = the minibatch's longest response
  when it is not configured) and multiplied by the world size. FSDP averages gradients over
  ranks, so the reduced gradient is exactly the full minibatch's, whatever the split;
* a rank left without groups in a minibatch runs one masked dummy row, so every rank makes the
  same collective calls.

With one process (`ctx` None or world size 1) this is `ppo_update` itself, numerically.
Not supported with more than one rank: loss dpo/ipo (their mean over pairs has no global
denominator in `compute_loss`) and the gae estimator (the critic of `value_head.py` is not sharded).
"""

from __future__ import annotations

import dataclasses

import torch

from areal_core.distributed import DistContext, clip_grad_norm
from areal_core.protocol import Sample
from areal_core.train.batch import TrainBatch, collate

# per-minibatch metrics that are counts over the rows (summed over ranks, not averaged)
SUMMED = {"policy_tokens", "pref_pairs"}


def rank_groups(groups: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of `groups` (group indices), possibly empty."""
    return torch.tensor_split(groups, world)[rank]


def _to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    return TrainBatch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(TrainBatch)))


def distributed_ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    cfg,
    pad_id: int,
    ctx: DistContext | None = None,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """One training step on complete groups (the same `samples` on every rank); returns metrics
    (loss summed over ranks = the full batch's loss; other per-minibatch metrics token-weighted
    over ranks; advantage metrics of the whole batch)."""
    from areal_core.train.algorithm import compute_advantages, compute_loss, required_inputs
    from areal_core.train.trainer import policy_logprobs

    ctx = ctx or DistContext()
    world, rank = ctx.world_size, ctx.rank
    algo, n_mb = cfg.algo, cfg.train.ppo_minibatches
    if world > 1 and (algo.loss in ("dpo", "ipo") or algo.adv_estimator == "gae"):
        raise NotImplementedError(f"distributed step: loss {algo.loss} / estimator {algo.adv_estimator}")
    batch = _to(collate(samples, pad_id), ctx.torch_device)
    need = required_inputs(algo)
    if "ref_logp" in need and ref_model is None:
        raise ValueError("this algorithm needs a reference model")

    # (my rows, dummy?, denominators) per minibatch
    plan = []
    for mb in range(n_mb):
        in_mb = (batch.group_index % n_mb) == mb
        groups = torch.unique(batch.group_index[in_mb])
        mine = torch.isin(batch.group_index, rank_groups(groups, rank, world)) & in_mb
        rows = torch.nonzero(mine).flatten()
        dummy = len(rows) == 0
        if dummy:
            rows = torch.nonzero(in_mb).flatten()[:1]
        mask = batch.loss_mask[in_mb]
        per_row = mask.sum(1)
        denominators = {
            "global_tokens": float(mask.sum().clamp(min=1)),
            "global_seqs": float((per_row > 0).sum().clamp(min=1)),
            "max_row_tokens": float(per_row.max().clamp(min=1)),
        }
        plan.append((rows, dummy, denominators))
    my_rows = torch.cat([rows for rows, _, _ in plan])

    prox_all = ref_all = None
    with torch.no_grad():
        # kl_as_reward shapes the rewards with π_prox vs π_ref on the whole batch before the
        # group statistics: every rank computes them on all rows. Otherwise only on its rows.
        full = algo.kl_as_reward
        rows_needed = None if (full or world == 1) else my_rows
        if n_mb > 1 or algo.kl_as_reward:
            prox_all = _scatter(policy_logprobs(model, batch, rows_needed, cfg, pad_id), rows_needed, batch)
        if "ref_logp" in need:
            ref_all = _scatter(policy_logprobs(ref_model, batch, rows_needed, cfg, pad_id), rows_needed, batch)
    adv, returns, stats = compute_advantages(
        algo,
        batch.rewards,
        batch.group_index,
        batch.loss_mask,
        prox_logp=prox_all if full else None,
        ref_logp=ref_all if full else None,
    )

    for rows, dummy, den in plan:
        out = policy_logprobs(model, batch, rows, cfg, pad_id, entropy="entropy" in need)
        logp, ent = out if isinstance(out, tuple) else (out, None)
        prox = logp.detach() if prox_all is None else prox_all[rows]
        mask = torch.zeros_like(batch.loss_mask[rows]) if dummy else batch.loss_mask[rows]
        mb_algo = algo
        if algo.aggregation == "seq_mean_token_sum_norm" and algo.norm_const <= 0:
            mb_algo = algo.model_copy(update={"norm_const": den["max_row_tokens"]})
        local_loss, mb_stats = compute_loss(
            mb_algo,
            logp,
            prox,
            batch.behav_logprobs[rows],
            batch.rewards[rows],
            batch.group_index[rows],
            mask,
            ref_logp=None if ref_all is None else ref_all[rows],
            entropy=ent,
            advantages=adv[rows],
            returns=None if returns is None else returns[rows],
            global_tokens=den["global_tokens"] if world > 1 else None,
            global_seqs=den["global_seqs"] if world > 1 else None,
        )
        optimizer.zero_grad(set_to_none=True)
        (local_loss * world).backward()
        grad_norm = clip_grad_norm(model, cfg.train.grad_clip or float("inf"))
        optimizer.step()
        share = float(mask.sum()) / den["global_tokens"]
        keys = sorted(k for k in mb_stats if k != "loss")
        weights = [1.0 if k in SUMMED else share for k in keys]  # counts add up; means are token-weighted
        reduced = ctx.all_reduce_sum([local_loss.item()] + [mb_stats[k] * w for k, w in zip(keys, weights)])
        mb_out = dict(zip(["loss", *keys], reduced))
        if world == 1:
            mb_out = {**mb_stats, "loss": local_loss.item()}
        mb_out["grad_norm"] = grad_norm
        for k, v in mb_out.items():
            stats[k] = stats.get(k, 0.0) + v / n_mb
    stats["reward_mean"] = batch.rewards.mean().item()
    stats["response_tokens"] = batch.loss_mask.sum().item()
    return stats


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, batch: TrainBatch) -> torch.Tensor:
    """Per-row values computed for `rows` placed into a full [N, T] tensor (zeros elsewhere)."""
    if rows is None:
        return values
    out = torch.zeros(batch.loss_mask.shape, dtype=values.dtype, device=values.device)
    out[rows] = values
    return out
