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
from areal_core.train.distributed import DistContext
from areal_core.train.entropy import token_logprobs_and_entropy
from areal_core.train.logprobs import token_logprobs
from areal_core.train.loss.common import behaviour_abs_diff
from areal_core.train.loss.registry import LossInputs, check_algorithm
from areal_core.train.micro_batches import SUMMED, aligned, split_rows
from areal_core.train.minibatches import Minibatch, minibatch_algo, minibatch_update, plan_minibatches
from areal_core.train.packing import packed_token_logprobs
from areal_core.train.router_replay import RouteReplay, RouteTally, route_gap_metrics
from areal_core.train.value_head import Critic
from areal_core.train.zero_advantage import inert_rows, skip_refusal, trained_rows
from areal_core.vlm.inputs import MultimodalRows, vision_token_ids

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


@dataclass
class StepBatch:
    """One step's batch and what its forwards share: micro-batching, images, the replayed routes."""

    batch: TrainBatch
    cfg: RunConfig
    pad_id: int
    ctx: DistContext
    mm: MultimodalRows | None
    moe: bool  # the model routes experts and the batch carries the rollout's routes

    def __post_init__(self) -> None:
        self.budget = self.cfg.train.max_tokens_per_micro_batch
        self.lengths = self.batch.attention_mask.sum(1)
        # "force": the rollout's routes replayed on the policy's forwards (algo.router_replay); else ""
        self.replay = "force" if self.moe and self.cfg.algo.router_replay == "rollout" else ""

    def passes(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """`rows` as micro-batches, (rows, padding) each, as many on every rank (module docstring)."""
        if self.budget <= 0:
            return [(rows, False)]
        return aligned(split_rows(rows, self.batch.group_index, self.lengths, self.budget), self.ctx)

    def no_grad_logprobs(
        self, m: torch.nn.Module, rows: torch.Tensor | None, routing: str = "", tally: RouteTally | None = None
    ) -> torch.Tensor:
        """[N, T] log-probs of `rows` (all when None) under `m`, a micro-batch at a time; `routing`
        "force" / "observe": the recorded routes replayed / compared (`_routes`)."""
        batch, cfg, pad_id, mm = self.batch, self.cfg, self.pad_id, self.mm
        if self.budget <= 0:
            with _routes(m, batch, rows, routing, tally):
                values = policy_logprobs(m, batch, rows, cfg, pad_id, mm=mm, unpacked=bool(routing))
            return _scatter(values, rows, batch)
        out = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device)
        every = torch.arange(len(batch.rewards), device=out.device) if rows is None else rows
        for part, padding in self.passes(every):
            with _routes(m, batch, part, routing, tally):
                values = policy_logprobs(m, batch, part, cfg, pad_id, mm=mm, unpacked=bool(routing))
            if not padding:
                out[part] = values
        return out


@dataclass
class FrozenLogprobs:
    """[N, T] log-probs before the update, None where not needed: π_prox (only with several
    minibatches or kl_as_reward), π_ref and the teacher's; and the route probe's metrics."""

    prox: torch.Tensor | None
    ref: torch.Tensor | None
    teacher: torch.Tensor | None
    route_stats: dict[str, float]


@dataclass
class Advantages:
    """The whole batch's advantages [N, T], GAE returns and the critic's pre-update values (else None)."""

    advantages: torch.Tensor
    returns: torch.Tensor | None
    old_values: torch.Tensor | None
    stats: dict[str, float]


@dataclass
class PolicyPass:
    """One micro-batch's forward: log π_θ (with gradient) and its entropy, π_prox, the loss mask
    (zeros on a dummy or padding pass) and the critic's values (with gradient)."""

    rows: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor | None
    prox: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None


def check_step_inputs(
    need: set[str],
    ctx: DistContext,
    ref_model: torch.nn.Module | None,
    teacher_model: torch.nn.Module | None,
    critic: Critic | None,
    mm: MultimodalRows | None,
) -> None:
    """ValueError when the algorithm's inputs (`need`, `required_inputs`) lack their model."""
    if "ref_logp" in need and ref_model is None:
        raise ValueError("this algorithm needs a reference model")
    if "teacher_logp" in need and teacher_model is None:
        raise ValueError("this algorithm needs a teacher model (algo.distill.teacher_path)")
    if "values" in need and critic is None:
        raise ValueError("algo.adv_estimator=gae needs a critic (areal_core/train/value_head.py)")
    if mm is not None and (critic is not None or ctx.distributed):
        raise ValueError("image batches train on one rank without a critic for now (docs/vlm.md)")


def frozen_logprobs(
    model: torch.nn.Module,
    step: StepBatch,
    plan: list[Minibatch],
    need: set[str],
    ref_model: torch.nn.Module | None,
    teacher_model: torch.nn.Module | None,
) -> FrozenLogprobs:
    """The no-grad passes before the update. kl_as_reward shapes the rewards with π_prox vs π_ref
    on the whole batch before the group statistics: every rank computes them on all rows;
    otherwise each rank only on its rows. The route probe runs on every rank, every row (the same
    collective forwards), when the model is an MoE with recorded routes and algo.route_metrics."""
    algo, ctx = step.cfg.algo, step.ctx
    prox = ref = teacher = None
    with torch.no_grad():
        rows_needed = None if (algo.kl_as_reward or not ctx.distributed) else torch.cat([m.rows for m in plan])
        if step.cfg.train.ppo_minibatches > 1 or algo.kl_as_reward:
            prox = step.no_grad_logprobs(model, rows_needed, step.replay)
        if "ref_logp" in need:
            ref = step.no_grad_logprobs(ref_model, rows_needed)
        if "teacher_logp" in need:
            teacher = step.no_grad_logprobs(teacher_model, rows_needed)
        route_stats = {}
        if step.moe and algo.route_metrics:
            route_stats = route_probe(
                lambda routing, tally: step.no_grad_logprobs(model, None, routing, tally), step.batch
            )
    return FrozenLogprobs(prox, ref, teacher, route_stats)


def batch_advantages(step: StepBatch, frozen: FrozenLogprobs, critic: Critic | None) -> Advantages:
    """`compute_advantages` on the whole batch (group and batch statistics), with the critic's
    values before the update (gae) and, under kl_as_reward, the reward r − β·KL(π_prox‖π_ref)."""
    batch, algo = step.batch, step.cfg.algo
    old_values = None
    if critic is not None:
        old_values = critic.token_values(batch.input_ids, batch.attention_mask, grad=False, **_value_kwargs(step))
    advantages, returns, stats = compute_advantages(
        algo,
        batch.rewards,
        batch.group_index,
        batch.loss_mask,
        prox_logp=frozen.prox if algo.kl_as_reward else None,
        ref_logp=frozen.ref if algo.kl_as_reward else None,
        old_values=old_values,
    )
    return Advantages(advantages, returns, old_values, stats)


def policy_pass(
    model: torch.nn.Module,
    step: StepBatch,
    rows: torch.Tensor,
    masked: bool,
    entropy: bool,
    frozen: FrozenLogprobs,
    critic: Critic | None,
) -> PolicyPass:
    """The forward of `rows` with gradient. π_prox is the parameters before this update: with one
    minibatch that is this very forward pass (detached), else the no-grad pass's. `masked`: a
    dummy or padding pass, its loss mask zero."""
    batch = step.batch
    out = policy_logprobs(
        model, batch, rows, step.cfg, step.pad_id, entropy=entropy, mm=step.mm, unpacked=bool(step.replay)
    )
    logp, ent = out if isinstance(out, tuple) else (out, None)
    prox = logp.detach() if frozen.prox is None else frozen.prox[rows]
    mask = torch.zeros_like(batch.loss_mask[rows]) if masked else batch.loss_mask[rows]
    values = None
    if critic is not None:  # the critic's values of these rows, with gradient
        values = critic.token_values(batch.input_ids[rows], batch.attention_mask[rows], **_value_kwargs(step))
    return PolicyPass(rows, logp, ent, prox, mask, values)


def loss_inputs(
    batch: TrainBatch, fwd: PolicyPass, frozen: FrozenLogprobs, adv: Advantages, mb: Minibatch, split: bool
) -> LossInputs:
    """The loss's view of one micro-batch: `fwd`'s rows of every per-row tensor; `split` (several
    ranks or micro-batches): the minibatch's denominators, not these rows'."""
    rows = fwd.rows

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return LossInputs(
        logp=fwd.logp,
        prox_logp=fwd.prox,
        behav_logp=batch.behav_logprobs[rows],
        mask=fwd.mask.float(),
        rewards=batch.rewards[rows],
        group_index=batch.group_index[rows],
        advantages=adv.advantages[rows],
        returns=pick(adv.returns),
        ref_logp=pick(frozen.ref),
        values=fwd.values,
        old_values=pick(adv.old_values),
        entropy=fwd.entropy,
        teacher_logp=pick(frozen.teacher),
        global_tokens=mb.global_tokens if split else None,
        global_seqs=mb.global_seqs if split else None,
    )


def minibatch_backward(
    model: torch.nn.Module,
    step: StepBatch,
    mb: Minibatch,
    frozen: FrozenLogprobs,
    adv: Advantages,
    critic: Critic | None,
    lap: _Laps,
    inert: torch.Tensor | None = None,
) -> tuple[list[tuple[dict[str, float], float]], int]:
    """Forward, loss and backward of each micro-batch of `mb`, the gradients accumulated; returns
    (metrics, policy tokens) per micro-batch and the number of micro-batches. The backward is of
    W · L_r (module docstring), so FSDP's average over ranks is the minibatch's gradient. `inert`:
    the [N] rows left out because their advantages are all zero (areal_core/train/zero_advantage.py)."""
    algo, need = minibatch_algo(step.cfg.algo, mb), required_inputs(step.cfg.algo)
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2: reduce gradients after the last micro-batch
    parts = []
    reach = None if step.mm is None else torch.tensor([m is not None for m in step.mm.per_row], device=mb.rows.device)
    rows_trained, none_left = trained_rows(mb.rows, inert, reach)
    nothing_trained = none_left and bool(inert[mb.members].all())  # on no rank either
    micro = step.passes(rows_trained)
    # the minibatch's denominators, not these rows'
    split = step.ctx.distributed or len(micro) > 1 or len(rows_trained) < len(mb.rows)
    for k, (rows, padding) in enumerate(micro):
        lap("forward")
        # algo.router_replay: the rollout's experts, held through the backward (checkpointed layers recompute)
        with _routes(model, step.batch, rows, step.replay):
            fwd = policy_pass(model, step, rows, mb.dummy or none_left or padding, "entropy" in need, frozen, critic)
            inputs = loss_inputs(step.batch, fwd, frozen, adv, mb, split)
            loss, micro_stats = total_loss(algo, inputs)
            seen = fwd
            if nothing_trained and not (mb.dummy or padding):  # the figures of the inert row run (its loss: 0)
                seen = dataclasses.replace(fwd, mask=step.batch.loss_mask[rows])
                inputs = loss_inputs(step.batch, seen, frozen, adv, mb, split)
                update = {k: v for k, v in micro_stats.items() if k == "loss" or k in SUMMED}  # nothing trained
                micro_stats = {**total_loss(algo, inputs)[1], **update}
            micro_stats["abs_dlogp_behav_prox"] = behaviour_abs_diff(seen.prox, inputs.behav_logp, inputs.mask)
            parts.append((micro_stats, float(seen.mask.sum())))
            lap("forward")
            if sync is not None and len(micro) > 1:
                sync(k == len(micro) - 1)
            (loss * step.ctx.world_size).backward()
            lap("backward")
    return parts, len(micro)


def step_metrics(
    averaged: dict[str, float], adv: Advantages, frozen: FrozenLogprobs, step: StepBatch
) -> dict[str, float]:
    """The minibatches' mean metrics, the whole batch's advantage metrics (not a minibatch's added
    to them), the route probe's, and the batch's reward mean, image rows and policy tokens."""
    stats = {**averaged, **adv.stats, **frozen.route_stats}
    stats["reward_mean"] = step.batch.rewards.mean().item()
    if step.mm is not None:  # the batch's rows with images
        stats["image_rows"] = float(sum(m is not None for m in step.mm.per_row))
    stats["response_tokens"] = step.batch.loss_mask.sum().item()
    return stats


# what a minibatch whose rows were all skipped reports with the others (its loss and update: 0, as without the
# skip); the means over the passes (ratios, importance weights, entropy, ...) average the minibatches that trained
# rows, and only in a step that trained none are they the inert rows' run for AdamW's sake
UPDATE_METRICS = frozenset(
    {"loss", "grad_norm", "nonfinite_grad_frac", "critic_grad_norm", "critic_nonfinite_grad_frac", "micro_batches"}
    | SUMMED
)


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
    "forward" (no-grad passes and the loss), "backward" and "optimizer" (clipping and the step).

    The steps: load (the batch and the minibatch plan) → the no-grad passes and advantages →
    per minibatch M, backward then update → metrics, each minibatch's weighted 1/n_mb (the means over the
    passes: over the minibatches that trained a row, UPDATE_METRICS)."""
    t0 = time.perf_counter()
    ctx = ctx or DistContext()
    algo, n_mb = cfg.algo, cfg.train.ppo_minibatches
    # ConfigError: an unknown loss, or one that needs all rows at once on several ranks or micro-batches
    check_algorithm(algo, distributed=ctx.distributed, micro_batches=cfg.train.max_tokens_per_micro_batch > 0)
    need = required_inputs(algo)
    check_step_inputs(need, ctx, ref_model, teacher_model, critic, mm)
    batch = _to(collate(samples, pad_id), ctx.torch_device if ctx.distributed else _device(model))
    plan = plan_minibatches(batch, n_mb, ctx.rank, ctx.world_size)
    lap = _Laps(phase, t0)
    lap("collate")  # the batch tensors and the minibatch plan (the laps start at the call)
    step = StepBatch(batch, cfg, pad_id, ctx, mm, moe=batch.routes is not None and bool(moe_routers(model)))

    frozen = frozen_logprobs(model, step, plan, need, ref_model, teacher_model)
    adv = batch_advantages(step, frozen, critic)

    inert = None
    if cfg.train.skip_zero_advantage and not skip_refusal(algo, critic is not None):
        inert = inert_rows(adv.advantages, batch.loss_mask)
    # per key: (sum, count) over the minibatches, and over those that trained no row their means over the passes
    # (the one inert row each ran), used only where no minibatch trained a row
    sums: dict[str, list[float]] = {}
    untrained: dict[str, list[float]] = {}
    for mb in plan:
        optimizer.zero_grad(set_to_none=True)
        if critic is not None:
            critic.zero_grad()
        parts, n_micro = minibatch_backward(model, step, mb, frozen, adv, critic, lap, inert)
        trained = None if inert is None else float(batch.loss_mask[mb.members[~inert[mb.members]]].sum())
        mb_stats = minibatch_update(model, optimizer, cfg.train.grad_clip, ctx, mb, critic, parts, n_micro, trained)
        for k, v in mb_stats.items():
            acc = (untrained if trained == 0.0 and k not in UPDATE_METRICS else sums).setdefault(k, [0.0, 0])
            acc[0], acc[1] = acc[0] + v, acc[1] + 1
        lap("optimizer")
    averaged = {k: total / n for k, (total, n) in (untrained | sums).items()}
    stats = step_metrics(averaged, adv, frozen, step)
    stats["zero_adv_rows_skipped"] = 0.0 if inert is None else float(inert.sum())
    return stats


def _value_kwargs(step: StepBatch) -> dict:
    return {"packing": step.cfg.train.packing, "pad_id": step.pad_id}


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
