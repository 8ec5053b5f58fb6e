"""Trainer checkpoints: trainer/checkpoints/step-{N}/ made visible by COMMITTED.

A checkpoint holds the model, the optimizer, RNG state, the consumed-shard set, the
buffered-but-untrained samples and the counters, so a restarted trainer continues exactly.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load

from areal_core.protocol import Sample, decode_shard, encode_shard
from areal_core.store import Store
from areal_core.weights.publisher import state_dict_bytes

PREFIX = "trainer/checkpoints"


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    # inclusive [lo, hi] ranges of published versions outside the trainer's lineage (train/lineage.py)
    abandoned: list[list[int]] = field(default_factory=list)


def save(
    store: Store,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pending: list[Sample],
    keep: int = 2,
    model_bytes: bytes | None = None,
    optimizer_state: dict | None = None,
) -> None:
    """Write step-{N}/ and then COMMITTED; keep the newest `keep` checkpoints.

    `model_bytes` / `optimizer_state`: the full (unsharded) model as safetensors bytes and the
    optimizer state in single-process `state_dict()` form, for a model sharded with FSDP2
    (areal_core.distributed gathers them); by default taken from `model` and `optimizer`.
    The format is the same either way, so a checkpoint restores under any world size.
    """
    base = f"{PREFIX}/step-{state.step:06d}"
    store.write_bytes(f"{base}/model.safetensors", model_bytes if model_bytes is not None else state_dict_bytes(model))
    buf = io.BytesIO()
    osd = optimizer_state if optimizer_state is not None else optimizer.state_dict()
    torch.save({"optimizer": osd, "rng": torch.get_rng_state()}, buf)
    store.write_bytes(f"{base}/optimizer.pt", buf.getvalue())
    store.write_bytes(f"{base}/pending.arrow", encode_shard(pending) if pending else b"")
    store.write_json(f"{base}/state.json", asdict(state))
    store.write_text(f"{base}/COMMITTED", str(state.step))
    for old in committed_steps(store)[:-keep]:
        store.delete(f"{PREFIX}/step-{old:06d}", recursive=True)


def committed_steps(store: Store) -> list[int]:
    steps = []
    for name in store.listdir(PREFIX):
        if name.startswith("step-") and store.exists(f"{PREFIX}/{name}/COMMITTED"):
            steps.append(int(name[5:]))
    return sorted(steps)


def restore(
    store: Store, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[TrainerState, list[Sample]] | None:
    """Load the newest committed checkpoint into model and optimizer; None when there is none."""
    steps = committed_steps(store)
    if not steps:
        return None
    base = f"{PREFIX}/step-{steps[-1]:06d}"
    model.load_state_dict(st_load(store.read_bytes(f"{base}/model.safetensors")), strict=False)
    blob: dict[str, Any] = torch.load(io.BytesIO(store.read_bytes(f"{base}/optimizer.pt")), weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"])
    state = TrainerState(**store.read_json(f"{base}/state.json"))
    raw = store.read_bytes(f"{base}/pending.arrow")
    return state, decode_shard(raw) if raw else []
