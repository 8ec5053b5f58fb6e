"""One training step: the configured advantage estimator and loss (decoupled PPO by default) on
complete groups, `train.ppo_minibatches` optimizer steps. World size 1 is the ordinary case;
under FSDP2 (`areal_core/train/distributed.py`) the same code runs on every rank and the
collectives, identities at world size 1, sit only at the reductions.

Per step, with the batch B (every rank receives all of it; rank 0 chose it):
  1. advantages on the whole batch (`compute_advantages`; a critic, when the estimator is gae,
     gives its values before the update);
  2. π_prox = the parameters before the update: one no-grad pass when there are several
     minibatches (or kl_as_reward needs it for the rewards), else the minibatch's own forward;
  3. per minibatch M = the groups g with g mod n_mb = mb: each rank keeps a contiguous block of
     whole groups of M (`rank_groups`; whole groups keep group-level terms such as preference
     pairs on one rank), its loss aggregated with M's denominators (tokens, sequences, and
     Dr.GRPO's constant = M's longest response when not configured) and multiplied by the world
     size W. FSDP averages gradients over ranks, so the reduced gradient is M's:
        ∇L_M = (1/W) Σ_r ∇(W · L_r)  with  L_M = Σ_r L_r;
     a rank left without groups in M runs one masked dummy row, so every rank makes the same
     collective calls;
  4. backward, gradient clipping (the global norm over every shard), optimizer step; a step whose
     norm is not finite is skipped and counted (`nonfinite_grad_frac`), so its NaN never reaches
     the weights, the optimizer's moments or a published version.

Not supported with more than one rank: the losses that declare `distributed = False` in the loss
registry (areal_core/train/loss/): the preference losses (their mean over pairs has no global
denominator) and the critic's value term (the critic of `value_head.py` is not sharded).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from areal_core.config import RunConfig
from areal_core.protocol import Sample
from areal_core.routes import moe_routers
from areal_core.train.algorithm import compute_advantages, required_inputs, total_loss
from areal_core.train.batch import TrainBatch, collate
from areal_core.train.distributed import DistContext, clip_grad_norm
from areal_core.train.entropy import token_logprobs_and_entropy
from areal_core.train.logprobs import token_logprobs
from areal_core.train.loss.common import behaviour_abs_diff
from areal_core.train.loss.registry import LossInputs, check_algorithm
from areal_core.train.micro_batches import SUMMED, aligned, combine, split_rows
from areal_core.train.packing import packed_token_logprobs
from areal_core.train.router_replay import RouteReplay, RouteTally, route_gap_metrics
from areal_core.train.value_head import Critic
from areal_core.vlm.inputs import MultimodalRows, vision_token_ids


@dataclass
class Minibatch:
    """This rank's rows of one minibatch and the minibatch's denominators (over every rank)."""

    rows: torch.Tensor  # row indices into the batch
    dummy: bool  # no group of this minibatch is this rank's: one masked row keeps collectives aligned
    global_tokens: float
    global_seqs: float
    max_row_tokens: float


FULL_LOGITS_MAX = 2**25  # logit values (128 MB in float32) under which the head runs on all tokens at once


def policy_logprobs(
    model,
    batch: TrainBatch,
    rows: torch.Tensor | None,
    cfg: RunConfig,
    pad_id: int,
    entropy: bool = False,
    mm: MultimodalRows | None = None,
    unpacked: bool = False,
):
    """Per-token log-probs (and entropy) of `rows` of the batch (all when None), packed without
    padding when configured (each group's shared prompt computed once) and not `unpacked` (a
    forward whose routes are replayed or observed: one row per sample). `mm`: the rows' images
    (a VLM batch, areal_core/vlm/inputs.py): unpacked, with pixel values and mrope positions."""
    ids, attn, groups = batch.input_ids, batch.attention_mask, batch.group_index
    if rows is not None:
        ids, attn, groups = ids[rows], attn[rows], groups[rows]
    temperature = cfg.rollout.temperature or 1.0
    banned = vision_token_ids(getattr(model, "config", None))  # a VLM's placeholders, masked as the engine masks them
    if mm is not None or banned:
        extra = mm.model_inputs(model, rows, ids, attn) if mm is not None else {}
        return token_logprobs(model, ids, attn, temperature, banned, with_entropy=entropy, **extra)
    chunk = cfg.train.logit_chunk_tokens
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if ids.numel() * vocab <= FULL_LOGITS_MAX:  # small logits: all at once is faster (no recompute)
        chunk = 0
    if cfg.train.packing and not unpacked:
        return packed_token_logprobs(
            model,
            ids,
            attn,
            temperature,
            pad_id=pad_id,
            with_entropy=entropy,
            group_index=groups,
            logit_chunk=chunk,
            attention=cfg.train.packed_attention,
        )
    if entropy and chunk <= 0:
        return token_logprobs_and_entropy(model, ids, attn, temperature)
    return token_logprobs(model, ids, attn, temperature, with_entropy=entropy, logit_chunk=chunk)


def _routes(
    model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor | None, routing: str, tally: RouteTally | None = None
) -> AbstractContextManager:
    """`model`'s routers on `rows`' recorded routes while entered (train/router_replay.py): "force"
    replays them, "observe" counts agreement into `tally`; "" (or a batch without routes) nothing."""
    if not routing or batch.routes is None:
        return nullcontext()
    routes = batch.routes if rows is None else batch.routes[rows.cpu()]  # kept on the host (a layer at a time moves)
    return RouteReplay(model, routes, force=routing == "force", tally=tally)


def route_probe(logprobs: Callable[[str, RouteTally | None], torch.Tensor], batch: TrainBatch) -> dict[str, float]:
    """Routing agreement and the behaviour gap with and without replay, over the whole batch under
    the parameters before the update: `logprobs(routing, tally)` run twice, the trainer's own routes
    observed, then the rollout's forced (router_replay.route_gap_metrics)."""
    tally = RouteTally()
    own = logprobs("observe", tally)
    replayed = logprobs("force", None)
    return route_gap_metrics(own, replayed, batch.behav_logprobs, batch.loss_mask, tally)


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
                dummy,
                global_tokens=float(per_row.sum().clamp(min=1)),
                global_seqs=float((per_row > 0).sum().clamp(min=1)),
                max_row_tokens=float(per_row.max().clamp(min=1)),
            )
        )
    return plan


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    cfg: RunConfig,
    pad_id: int,
    *,
    ctx: DistContext | None = None,
    ref_model: torch.nn.Module | None = None,
    critic: Critic | None = None,
    mm: MultimodalRows | None = None,
    teacher_model: torch.nn.Module | None = None,
    phase: Callable[[str, float], None] | None = None,
) -> dict[str, float]:
    """One training step on complete groups (the same `samples` on every rank); returns metrics:
    advantage metrics of the whole batch, per-minibatch metrics averaged over minibatches (the
    loss summed over ranks = the minibatch's loss, other metrics token-weighted over ranks).
    `critic` (needed for adv_estimator=gae) is trained on the same loss (its value term) with
    its own optimizer. `mm`: the samples' images (a VLM batch; areal_core/vlm/inputs.py).
    `phase(name, seconds)` (e.g. `EventLog.add`) is told the seconds spent in
    "forward" (no-grad passes and the loss), "backward" and "optimizer" (clipping and the step)."""
    t0 = time.perf_counter()
    ctx = ctx or DistContext()
    world = ctx.world_size
    algo, n_mb = cfg.algo, cfg.train.ppo_minibatches
    # ConfigError: an unknown loss, or one that needs all rows at once on several ranks or micro-batches
    check_algorithm(algo, distributed=ctx.distributed, micro_batches=cfg.train.max_tokens_per_micro_batch > 0)
    need = required_inputs(algo)
    if "ref_logp" in need and ref_model is None:
        raise ValueError("this algorithm needs a reference model")
    if "teacher_logp" in need and teacher_model is None:
        raise ValueError("this algorithm needs a teacher model (algo.distill.teacher_path)")
    if "values" in need and critic is None:
        raise ValueError("algo.adv_estimator=gae needs a critic (areal_core/train/value_head.py)")
    if mm is not None and (critic is not None or ctx is not None and ctx.distributed):
        raise ValueError("image batches train on one rank without a critic for now (docs/vlm.md)")
    batch = _to(collate(samples, pad_id), ctx.torch_device if ctx.distributed else _device(model))
    plan = plan_minibatches(batch, n_mb, ctx.rank, world)
    lap = _Laps(phase, t0)
    lap("collate")  # the batch tensors and the minibatch plan (the laps start at the call)

    budget = cfg.train.max_tokens_per_micro_batch
    lengths = batch.attention_mask.sum(1)

    def passes(rows: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """`rows` as micro-batches, (rows, padding) each, as many on every rank (module docstring)."""
        if budget <= 0:
            return [(rows, False)]
        return aligned(split_rows(rows, batch.group_index, lengths, budget), ctx)

    def no_grad_logprobs(
        m: torch.nn.Module, rows: torch.Tensor | None, routing: str = "", tally: RouteTally | None = None
    ) -> torch.Tensor:
        """[N, T] log-probs of `rows` (all when None) under `m`, a micro-batch at a time; `routing`
        "force" / "observe": the recorded routes replayed / compared (`_routes`)."""
        if budget <= 0:
            with _routes(m, batch, rows, routing, tally):
                values = policy_logprobs(m, batch, rows, cfg, pad_id, mm=mm, unpacked=bool(routing))
            return _scatter(values, rows, batch)
        out = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device)
        every = torch.arange(len(batch.rewards), device=out.device) if rows is None else rows
        for part, padding in passes(every):
            with _routes(m, batch, part, routing, tally):
                values = policy_logprobs(m, batch, part, cfg, pad_id, mm=mm, unpacked=bool(routing))
            if not padding:
                out[part] = values
        return out

    moe = batch.routes is not None and bool(moe_routers(model))
    replay = "force" if moe and algo.router_replay == "rollout" else ""

    prox_all = ref_all = teacher_all = None
    with torch.no_grad():
        # kl_as_reward shapes the rewards with π_prox vs π_ref on the whole batch before the group
        # statistics: every rank computes them on all rows. Otherwise each rank only on its rows.
        rows_needed = None if (algo.kl_as_reward or not ctx.distributed) else torch.cat([m.rows for m in plan])
        if n_mb > 1 or algo.kl_as_reward:
            prox_all = no_grad_logprobs(model, rows_needed, replay)
        if "ref_logp" in need:
            ref_all = no_grad_logprobs(ref_model, rows_needed)
        if "teacher_logp" in need:
            teacher_all = no_grad_logprobs(teacher_model, rows_needed)
        route_stats = {}
        if moe and algo.route_metrics:  # every rank, every row: the same collective forwards
            route_stats = route_probe(lambda routing, tally: no_grad_logprobs(model, None, routing, tally), batch)
    vkw = {"packing": cfg.train.packing, "pad_id": pad_id}
    old_v = None
    if critic is not None:
        old_v = critic.token_values(batch.input_ids, batch.attention_mask, grad=False, **vkw)
    adv, returns, stats = compute_advantages(
        algo,
        batch.rewards,
        batch.group_index,
        batch.loss_mask,
        prox_logp=prox_all if algo.kl_as_reward else None,
        ref_logp=ref_all if algo.kl_as_reward else None,
        old_values=old_v,
    )

    averaged: dict[str, float] = {}
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2: reduce gradients after the last micro-batch
    for mb in plan:
        optimizer.zero_grad(set_to_none=True)
        if critic is not None:
            critic.zero_grad()
        mb_algo = algo
        if algo.aggregation == "seq_mean_token_sum_norm" and algo.norm_const <= 0:
            mb_algo = algo.model_copy(update={"norm_const": mb.max_row_tokens})
        parts = []
        micro = passes(mb.rows)
        for k, (rows, padding) in enumerate(micro):
            lap("forward")
            # algo.router_replay: the rollout's experts, held through the backward (checkpointed layers recompute)
            with _routes(model, batch, rows, replay):
                out = policy_logprobs(
                    model, batch, rows, cfg, pad_id, entropy="entropy" in need, mm=mm, unpacked=bool(replay)
                )
                logp, ent = out if isinstance(out, tuple) else (out, None)
                # π_prox: the parameters before this update; with one minibatch that is this very forward pass
                prox = logp.detach() if prox_all is None else prox_all[rows]
                mask = torch.zeros_like(batch.loss_mask[rows]) if mb.dummy or padding else batch.loss_mask[rows]
                values = None
                if critic is not None:  # the critic's values of these rows, with gradient
                    values = critic.token_values(batch.input_ids[rows], batch.attention_mask[rows], **vkw)
                split = ctx.distributed or len(micro) > 1  # the minibatch's denominators, not these rows'
                inputs = LossInputs(
                    logp=logp,
                    prox_logp=prox,
                    behav_logp=batch.behav_logprobs[rows],
                    mask=mask.float(),
                    rewards=batch.rewards[rows],
                    group_index=batch.group_index[rows],
                    advantages=adv[rows],
                    returns=None if returns is None else returns[rows],
                    ref_logp=None if ref_all is None else ref_all[rows],
                    values=values,
                    old_values=None if old_v is None else old_v[rows],
                    entropy=ent,
                    teacher_logp=None if teacher_all is None else teacher_all[rows],
                    global_tokens=mb.global_tokens if split else None,
                    global_seqs=mb.global_seqs if split else None,
                )
                loss, micro_stats = total_loss(mb_algo, inputs)
                micro_stats["abs_dlogp_behav_prox"] = behaviour_abs_diff(
                    prox, inputs.behav_logp, inputs.mask
                )  # mismatch
                parts.append((micro_stats, float(mask.sum())))
                lap("forward")
                if sync is not None and len(micro) > 1:
                    sync(k == len(micro) - 1)
                (loss * world).backward()
                lap("backward")
        mb_stats = combine(parts)
        grad_norm = clip_grad_norm(model, cfg.train.grad_clip or float("inf"))
        # a NaN/inf gradient (the global norm: every rank skips alike) would poison the weights and
        # AdamW's moments, and the next published version with them: skip the update, count it
        finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        mb_stats["nonfinite_grad_frac"] = 0.0 if finite else 1.0
        if critic is not None:
            mb_stats["critic_grad_norm"] = critic.step()  # skipped, like the policy's, when not finite
            mb_stats["critic_nonfinite_grad_frac"] = 0.0 if math.isfinite(mb_stats["critic_grad_norm"]) else 1.0
        if ctx.distributed:
            rank_tokens = sum(t for _, t in parts)
            mb_stats = _reduce(mb_stats, rank_tokens / mb.global_tokens, ctx)
        mb_stats["grad_norm"] = grad_norm
        mb_stats["micro_batches"] = float(len(micro))
        for k, v in mb_stats.items():
            averaged[k] = averaged.get(k, 0.0) + v / n_mb
        lap("optimizer")
    stats = {**averaged, **stats, **route_stats}  # the whole batch's advantage metrics, not a minibatch's added to them
    stats["reward_mean"] = batch.rewards.mean().item()
    if mm is not None:  # the rows trained with their images in the forward passes
        stats["image_rows"] = float(sum(m is not None for m in mm.per_row))
    stats["response_tokens"] = batch.loss_mask.sum().item()
    return stats


class _Laps:
    """Tells `phase(name, seconds)` the time since the previous lap (nothing when `phase` is None).
    On an accelerator the seconds are host time: queued kernels land in a later phase."""

    def __init__(self, phase: Callable[[str, float], None] | None, t0: float | None = None):
        self.phase, self.t = phase, time.perf_counter() if t0 is None else t0

    def __call__(self, name: str) -> None:
        if self.phase is not None:
            now = time.perf_counter()
            self.phase(name, now - self.t)
            self.t = now


def _reduce(mb_stats: dict[str, float], share: float, ctx: DistContext) -> dict[str, float]:
    """One minibatch's metrics over every rank: the loss and counts summed, means token-weighted
    (`share` = this rank's fraction of the minibatch's tokens). Collective."""
    keys = ["loss", *sorted(k for k in mb_stats if k != "loss")]
    weights = [1.0 if k == "loss" or k in SUMMED else share for k in keys]
    return dict(zip(keys, ctx.all_reduce_sum([mb_stats[k] * w for k, w in zip(keys, weights)])))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(TrainBatch) if f.name != "routes"}
    return TrainBatch(**moved, routes=batch.routes)  # routes stay on the host: RouteReplay moves a layer per forward


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, batch: TrainBatch) -> torch.Tensor:
    """Per-row values computed for `rows` placed into a full [N, T] tensor (zeros elsewhere)."""
    if rows is None:
        return values
    out = torch.zeros(batch.loss_mask.shape, dtype=values.dtype, device=values.device)
    out[rows] = values
    return out
