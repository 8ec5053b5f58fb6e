"""Distributed training under torchrun (or Flyte's kfpytorch `Elastic` task): FSDP2.

Process group backend by device: gloo on cpu, nccl on cuda, hccl on npu (Ascend, through
torch_npu). Every rank holds a shard of the parameters and of the optimizer state
(`torch.distributed.fsdp.fully_shard`: one FSDP unit per decoder layer plus the root, which
keeps tied embeddings together). Rank 0 alone talks to the store: it picks each step's batch
(broadcast to the others), publishes weights, writes checkpoints and the audit log. Gathering
the full state dict for publication is collective, so every rank calls it; only rank 0 gets
the tensors.

    ctx = init_distributed(cfg.device)               # reads RANK / WORLD_SIZE / LOCAL_RANK
    model = shard_model(model, ctx)                  # before the optimizer is created
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    samples = ctx.broadcast_object(samples)          # rank 0's choice
    stats = train_step(model, optimizer, samples, cfg, pad_id, ctx=ctx)   # train/step.py
    blob = state_dict_bytes_rank0(model, ctx)        # collective; bytes on rank 0, None elsewhere

With WORLD_SIZE unset or 1 (the ordinary case) there is no process group, the model is not
wrapped, and the collectives are identities.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("areal.distributed")

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # cpu | cuda | npu
    backend: str = "gloo"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(f"{self.device}:{self.local_rank}")

    # -- collectives (identities when not distributed) -------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s object on every rank (pickled; for batches of samples and small state)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.torch_device if self.device != "cpu" else "cpu")
        torch.distributed.all_reduce(t)
        return t.cpu().tolist()


def env_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun / torch elastic set them."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def backend_for(device: str) -> str:
    if device not in BACKENDS:
        raise ValueError(f"unknown device {device!r}; expected one of {sorted(BACKENDS)}")
    return BACKENDS[device]


def init_distributed(device: str = "cpu", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes in the environment (no-op for one process)."""
    rank, world, local_rank = env_ranks()
    ctx = DistContext(rank, world, local_rank, device, backend_for(device))
    if not ctx.distributed:
        return ctx
    if device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

        torch.npu.set_device(local_rank)
    elif device == "cuda":
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(ctx.backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.info("rank %d/%d (local %d) joined with %s on %s", rank, world, local_rank, ctx.backend, device)
    return ctx


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (Qwen2/Llama: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard_model(model: torch.nn.Module, ctx: DistContext, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, tied lm_head).

    Call before creating the optimizer: fully_shard replaces parameters with DTensor shards.
    A single process returns the model unchanged.
    """
    if not ctx.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(ctx.torch_device)
    mesh = init_device_mesh(ctx.device, (ctx.world_size,))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The unsharded CPU state dict on rank 0 ({} on other ranks). Collective: call on every rank."""
    if not ctx.distributed:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if ctx.is_main else {}


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], ctx: DistContext) -> None:
    """Load an unsharded state dict (needed on rank 0 only) into the sharded model."""
    if not ctx.distributed:
        model.load_state_dict(state, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )


def state_dict_bytes_rank0(model: torch.nn.Module, ctx: DistContext) -> bytes | None:
    """safetensors bytes of the full model on rank 0 (tied lm_head stored once, as
    areal_core.weights.publisher.state_dict_bytes does); None on other ranks. Collective."""
    from safetensors.torch import save as st_save

    sd = full_state_dict(model, ctx)
    if not ctx.is_main:
        return None
    sd = {k: v.contiguous() for k, v in sd.items()}
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return st_save(sd, metadata={"format": "pt"})


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict:
    """Unsharded, FQN-keyed optimizer state on rank 0 ({} elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not ctx.distributed:
        return get_optimizer_state_dict(model, optimizer)
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return osd if ctx.is_main else {}


def load_full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, osd: dict, ctx: DistContext
) -> None:
    """Load an FQN-keyed optimizer state (from `full_optimizer_state_dict`) into every rank's shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not ctx.distributed:
        set_optimizer_state_dict(model, optimizer, osd)
        return
    set_optimizer_state_dict(
        model, optimizer, osd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def indexed_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict:
    """The full optimizer state on rank 0 in the format of a single-process `optimizer.state_dict()`
    (parameters numbered in `model.parameters()` order), so that trainer checkpoints written by a
    sharded run restore into an unsharded optimizer and vice versa. Collective; {} off rank 0."""
    osd = full_optimizer_state_dict(model, optimizer, ctx)
    if not ctx.is_main:
        return {}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {
        "state": {index[name]: value for name, value in osd["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in osd["param_groups"]],
    }


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (clipped to max_norm); DTensor-aware, so it spans every shard."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
