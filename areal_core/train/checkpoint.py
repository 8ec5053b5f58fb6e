"""Trainer checkpoints: trainer/checkpoints/step-{N}/ made visible by COMMITTED.

A checkpoint holds the model (under LoRA the adapter alone: the base never changes and is
init_model), the optimizer (state of the trained parameters only), RNG state, the consumed-shard set, the identities
of every sample consumed (`Sample.identity()`, gzipped: a copy of a consumed shard is skipped
after a restart too), the buffered-but-untrained samples and the counters, so a restarted
trainer continues exactly.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.manifest import MANIFEST_NAME, failures, make_manifest
from areal_core.protocol import (
    DEFAULT_LIMITS,
    Sample,
    ShardLimits,
    decode_identities,
    decode_shard,
    encode_identities,
    encode_shard,
)
from areal_core.store import Store, UnreadableObject
from areal_core.train.counters import TrainerCounters
from areal_core.train.drops import DropLog
from areal_core.weights.publisher import state_dict_bytes

MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter.safetensors"  # a LoRA trainer's checkpoint: peft's adapter tensors
OPTIMIZER_FILE = "optimizer.pt"
PENDING_FILE = "pending.arrow"
STATE_FILE = "state.json"
SEEN_FILE = "seen.txt.gz"

log = logging.getLogger("areal.trainer")


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: list[str] = field(default_factory=list)
    counters: TrainerCounters = field(default_factory=TrainerCounters)
    # inclusive [lo, hi] ranges of published versions outside the trainer's lineage (train/lineage.py)
    abandoned: list[list[int]] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # identities of the consumed samples (in SEEN_FILE)
    settled: dict[str, int] = field(default_factory=dict)  # online: live session rows settled per proxy
    drops: DropLog = field(default_factory=DropLog)  # dropped since the last checkpoint (in trainer/drops/, not here)


def save(
    store: Store,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pending: list[Sample],
    keep: int = 2,
    model_bytes: bytes | None = None,
    optimizer_state: dict | None = None,
    adapter: bool = False,
) -> None:
    """Write step-{N}/ and then COMMITTED; keep the newest `keep` checkpoints.

    `model_bytes` / `optimizer_state`: the full (unsharded) model as safetensors bytes and the
    optimizer state in single-process `state_dict()` form, for a model sharded with FSDP2
    (areal_core/train/distributed.py gathers them); by default taken from `model` and `optimizer`.
    The format is the same either way, so a checkpoint restores under any world size.
    `adapter`: `model` is a LoRA (peft) model; the adapter tensors alone are written.
    """
    step = state.step
    files: dict[str, bytes] = {}
    if adapter:
        from areal_core.train.lora import adapter_state_dict

        files[ADAPTER_FILE] = st_save(adapter_state_dict(model))
    else:
        files[MODEL_FILE] = model_bytes if model_bytes is not None else state_dict_bytes(model)
    buf = io.BytesIO()
    osd = optimizer_state if optimizer_state is not None else optimizer.state_dict()
    torch.save({"optimizer": osd, "rng": torch.get_rng_state()}, buf)
    files[OPTIMIZER_FILE] = buf.getvalue()
    files[PENDING_FILE] = encode_shard(pending) if pending else b""
    record = asdict(state)  # the counters as a plain dict
    record.pop("drops")  # written beside, as trainer/drops/step-{N}.json (train/drops.py)
    files[SEEN_FILE] = encode_identities(record.pop("seen"))
    files[STATE_FILE] = json.dumps(record, indent=1, sort_keys=True).encode()
    for name, data in files.items():
        store.write_bytes(LAYOUT.checkpoint_file(step, name), data)
    for rel in store.find(LAYOUT.checkpoint_dir(step)):  # written beside (the critic's files)
        name = rel.rsplit("/", 1)[-1]
        if name not in files and name not in (MANIFEST_NAME, LAYOUT.committed_name):
            files[name] = store.read_bytes(rel)
    store.write_json(LAYOUT.checkpoint_file(step, MANIFEST_NAME), make_manifest(files, step=step))
    state.drops.commit(store, step)  # before COMMITTED: a checkpoint that never commits leaves it to discard
    store.write_text(LAYOUT.committed(LAYOUT.checkpoint_dir(step)), str(step))
    for old in committed_steps(store)[:-keep]:
        store.delete(LAYOUT.checkpoint_dir(old), recursive=True)


class CheckpointError(RuntimeError):
    """Committed checkpoints exist and none of them verifies."""


def committed_steps(store: Store) -> list[int]:
    steps = []
    for name in store.listdir(LAYOUT.checkpoints_dir):
        step = LAYOUT.checkpoint_step(name)
        if step is not None and store.exists(LAYOUT.committed(LAYOUT.checkpoint_dir(step))):
            steps.append(step)
    return sorted(steps)


def verify(store: Store, step: int) -> list[str]:
    """What is wrong with committed checkpoint `step`: files missing or failing the sha256 its
    MANIFEST.json records, or the manifest itself missing (empty when it verifies)."""
    rel = LAYOUT.checkpoint_file(step, MANIFEST_NAME)
    if not store.exists(rel):  # every checkpoint is written with one: a missing manifest was removed
        return [f"no {MANIFEST_NAME}"]
    try:
        manifest = store.read_json(rel)
    except (ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, not a regular file
        return [f"{MANIFEST_NAME} does not parse ({str(exc)[:200] or type(exc).__name__})"]

    def read(name: str) -> bytes | None:
        path = LAYOUT.checkpoint_file(step, name)
        if "/" in name or not store.exists(path):
            return None
        try:
            return store.read_bytes(path)
        except UnreadableObject:  # a FIFO or a device where a file was: as good as missing
            return None

    return failures(manifest, read)


def restore(
    store: Store,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    skipped: list[tuple[int, str]] | None = None,
    limits: ShardLimits = DEFAULT_LIMITS,
) -> tuple[TrainerState, list[Sample]] | None:
    """Load the newest committed checkpoint that verifies into model and optimizer (a newer one
    that fails is skipped, said in one line and appended to `skipped` as (step, why)); None when
    there is none; CheckpointError when checkpoints exist and none verifies (starting over would
    silently lose the run)."""
    steps = committed_steps(store)
    if not steps:
        return None
    for step in reversed(steps):
        problems = verify(store, step)
        if not problems:
            try:
                return _load(store, step, model, optimizer, limits)
            except Exception as exc:  # verified bytes that still do not load (e.g. another model's)
                problems = [f"does not load: {type(exc).__name__}: {str(exc)[:200]}"]
        why = "; ".join(problems[:3])
        log.warning("checkpoint %s skipped: %s", LAYOUT.checkpoint_dir(step), why)
        if skipped is not None:
            skipped.append((step, why))
    raise CheckpointError(f"{store.uri}: none of the committed checkpoints {steps} verifies; refusing to start over")


def _load(
    store: Store, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, limits: ShardLimits
) -> tuple[TrainerState, list[Sample]]:
    if store.exists(LAYOUT.checkpoint_file(step, ADAPTER_FILE)):
        from peft import set_peft_model_state_dict

        tensors = st_load(store.read_bytes(LAYOUT.checkpoint_file(step, ADAPTER_FILE)))
        set_peft_model_state_dict(model, tensors)
    else:
        model.load_state_dict(st_load(store.read_bytes(LAYOUT.checkpoint_file(step, MODEL_FILE))), strict=False)
    # weights_only: a pickle from the store must not run code (the state dict is tensors and numbers)
    blob: dict[str, Any] = torch.load(
        io.BytesIO(store.read_bytes(LAYOUT.checkpoint_file(step, OPTIMIZER_FILE))), weights_only=True
    )
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"])
    record = store.read_json(LAYOUT.checkpoint_file(step, STATE_FILE))
    record.pop("drops", None)  # never saved here (trainer/drops/): a planted key cannot replace the log
    settled = {str(k): int(v) for k, v in dict(record.get("settled") or {}).items()}
    counters = TrainerCounters.from_json(record.get("counters"))
    state = TrainerState(**{**record, "counters": counters, "settled": settled})
    state.seen = decode_identities(store.read_bytes(LAYOUT.checkpoint_file(step, SEEN_FILE)))
    raw = store.read_bytes(LAYOUT.checkpoint_file(step, PENDING_FILE))
    return state, decode_shard(raw, limits) if raw else []  # the trainer's limits, as for any shard it reads
