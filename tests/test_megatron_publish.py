"""Publication from tensor-parallel shards (areal_core/megatron/publish.py): 2 gloo ranks each hold
one TP shard; rank 0 gathers them, converts to HF and publishes through weights/. The published
model.safetensors is byte for byte what the HF trainer publishes for the same weights, and the
rollout side loads it unchanged: `weights.reader.load_state_dict` (the in-process engines) and
`stage_verified` (the folder vLLM and SGLang load)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_core.megatron.convert import hf_to_megatron
from areal_core.megatron.shapes import ModelShape, shape_from_hf_config
from areal_core.megatron.shard import shard_state_dict
from areal_core.store import Store
from areal_core.weights.publisher import hf_side_files, state_dict_bytes
from areal_core.weights.reader import load_state_dict, stage_verified
from tests.test_megatron_convert import hf_logits, ids_batch, tiny_model


def _rank(rank: int, port: int, jobs: list[tuple[str, str, dict, dict[str, bytes]]]) -> None:
    """One gloo rank: for each (shards file, store, shape, side files), publish version 1."""
    from areal_core.megatron.publish import publish_from_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for shards_path, store_uri, shape, side in jobs:
            local = torch.load(shards_path, weights_only=True)[rank]
            took = publish_from_shards(Store(store_uri), 1, local, ModelShape(**shape), side)
            assert (took is None) == (rank != 0)
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loads_unchanged(store: Store, model: torch.nn.Module, tmp_path) -> None:
    """The version loads into a fresh model (other weights) and into a staged HF folder, and both
    give the trained model's logits exactly."""
    from transformers import AutoModelForCausalLM

    ids = ids_batch()
    fresh = tiny_model(model.config.model_type, seed=5)
    fresh.load_state_dict(load_state_dict(store, 1), strict=False)  # as rollout/factory.py loads
    assert torch.equal(hf_logits(fresh, ids), hf_logits(model, ids))
    folder = stage_verified(store, 1, tmp_path / "staging")
    staged = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert torch.equal(hf_logits(staged, ids), hf_logits(model, ids))


def test_tp2_shards_publish_the_hf_trainers_bytes_and_the_rollout_side_loads_them(tmp_path):
    models = {family: tiny_model(family) for family in ("qwen2", "llama")}
    jobs = []
    for family, model in models.items():
        shape = shape_from_hf_config(model.config)
        shards = shard_state_dict(hf_to_megatron(model.state_dict(), shape), 2, shape)
        torch.save(shards, tmp_path / f"{family}.pt")
        store_uri = Store(str(tmp_path / family)).uri
        jobs.append((str(tmp_path / f"{family}.pt"), store_uri, shape.as_dict(), hf_side_files(model, None)))
    mp.spawn(_rank, args=(_port(), jobs), nprocs=2)  # both families in one spawn: each costs a torch import
    for family, model in models.items():
        store = Store(str(tmp_path / family))
        assert store.latest_version() == 1
        assert store.read_bytes("weights/v000001/model.safetensors") == state_dict_bytes(model)
        loads_unchanged(store, model, tmp_path / f"{family}-staging")
