"""What a trainer trains with, loaded in one place: the model (LoRA-wrapped when configured), its
optimizer, the reference model, the teacher and the critic when the loss needs them, and the newest
committed checkpoint restored into them; sharded with FSDP2 under torchrun.

The order is fixed (seed, model, LoRA, optimizer, reference, teacher, critic, restore, shard) because
replay reproduces a run's steps bit for bit from the same seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from areal_core.config import ConfigError, RunConfig
from areal_core.models import load_pretrained
from areal_core.protocol import Sample, ShardLimits, shard_limits_for
from areal_core.routes import route_shape
from areal_core.store import Store
from areal_core.train import checkpoint, lora
from areal_core.train.algorithm import required_inputs
from areal_core.train.checkpoint import TrainerState
from areal_core.train.distributed import (
    DistContext,
    full_optimizer_state_dict,
    init_distributed,
    load_full_optimizer_state_dict,
    shard_model,
)
from areal_core.train.loss import check_algorithm
from areal_core.train.loss.distill import DistillSettings
from areal_core.train.value_head import Critic
from areal_core.weights.publisher import hf_side_files

log = logging.getLogger("areal.trainer")


@dataclass
class TrainerParts:
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    dist: DistContext
    model_url: str  # the weights the model was loaded from (an unsharded copy reloads them)
    lora: bool = False
    ref_model: torch.nn.Module | None = None
    critic: Critic | None = None
    teacher_model: torch.nn.Module | None = None  # algo.distill.teacher_path (empty: model_url), for 'teacher_logp'
    state: TrainerState = field(default_factory=TrainerState)  # restored, or a fresh one
    pending: list[Sample] = field(default_factory=list)  # the restored checkpoint's untrained samples
    side_files: dict[str, bytes] = field(default_factory=dict)  # config + tokenizer files of a published version
    skipped_checkpoints: list[tuple[int, str]] = field(default_factory=list)  # (step, why) passed over on restore


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, distributed: bool) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (under LoRA the adapter: no state for the frozen base)."""
    tc = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    fused = not distributed  # one kernel for all parameters (3x less CPU than per tensor)
    return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.99), fused=fused)


def load_parts(
    model_url: str, cfg: RunConfig, *, restore_from: Store | None = None, dist: DistContext | None = None
) -> TrainerParts:
    """The parts of a trainer on `model_url`'s weights; with `restore_from`, its newest committed
    checkpoint (if any) restored into them. Collective under torchrun: every rank restores the
    full model and optimizer, then shards them."""
    dist = dist or init_distributed(cfg.device)
    check_algorithm(cfg.algo, dist.distributed)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_pretrained(model_url, cfg.device)
    side_files = hf_side_files(model, tokenizer)
    model, is_lora = lora.with_lora(model, cfg.train, dist.distributed)
    if cfg.train.gradient_checkpointing:  # long rows: each layer's activations recomputed in the backward
        lora.set_gradient_checkpointing(model, True)
    if cfg.train.freeze_vision:  # before the optimizer: it keeps no state for what does not train
        from areal_core.vlm.model import freeze_vision_tower

        freeze_vision_tower(model)
    optimizer = make_optimizer(model, cfg, dist.distributed)
    need = required_inputs(cfg.algo)
    ref_model = None
    if "ref_logp" in need:
        ref_model, _ = load_pretrained(model_url, cfg.device)
        ref_model.eval().requires_grad_(False)
    teacher_model = None
    if "teacher_logp" in need:
        teacher_path = DistillSettings.of(cfg.algo).teacher_path
        teacher_model, teacher_tokenizer = load_pretrained(teacher_path or model_url, cfg.device)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"config key 'algo.distill.teacher_path': {teacher_path!r} has another tokenizer")
        teacher_model.eval().requires_grad_(False)
    critic = Critic.from_pretrained(model_url, cfg) if "values" in need else None  # checkpointed, never published
    parts = TrainerParts(
        model, tokenizer, optimizer, dist, model_url, is_lora, ref_model, critic, side_files=side_files
    )
    parts.teacher_model = teacher_model
    restored = (
        checkpoint.restore(restore_from, model, optimizer, parts.skipped_checkpoints, shard_limits(model))
        if restore_from is not None
        else None
    )
    if restored:
        parts.state, parts.pending = restored
        if critic is not None:
            critic.restore(restore_from, parts.state.step)
        st = parts.state
        log.info("resumed at step %d (version %d, %d pending samples)", st.step, st.version, len(parts.pending))
    if dist.distributed:
        # shard the restored full model, then move the optimizer state into the sharded optimizer
        osd = full_optimizer_state_dict(model, optimizer, DistContext()) if restored else None
        parts.model = shard_model(model, dist)
        parts.optimizer = make_optimizer(parts.model, cfg, True)
        if osd is not None:
            load_full_optimizer_state_dict(parts.model, parts.optimizer, osd, dist)
        if ref_model is not None:
            parts.ref_model = shard_model(ref_model, dist)
        if teacher_model is not None:
            parts.teacher_model = shard_model(teacher_model, dist)
    return parts


def shard_limits(model: torch.nn.Module) -> ShardLimits:
    """What the trainer accepts of a graded shard (protocol.shard_limits_for its model's config; an
    MoE's recorded routes must fit its routers: areal_core/routes.py)."""
    return replace(shard_limits_for(model.config), routes=route_shape(model))
