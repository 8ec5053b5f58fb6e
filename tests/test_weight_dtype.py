"""Issue 45: versions published in the dtype the engines load (train.weight_dtype), as bf16 deltas
against the previous version: half the bytes, bit-exact on rebuild, and at RL learning rates a
few percent of a full bf16 file per version."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load

from areal_core.config import load_config
from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.weights import DELTA_FILE
from areal_core.weights.publisher import WeightPublisher, cast_safetensors, published_dtype
from areal_core.weights.reader import load_state_dict, load_weights_bytes
from tests.test_weight_delta import SIDE, adamw_versions


@pytest.mark.parametrize(
    "overrides, dtype",
    [
        ([], "float32"),  # the CPU engines load float32: they get the trainer's weights exactly
        (["rollout.dtype=bfloat16"], "bfloat16"),
        (["rollout.dtype=auto"], "float32"),  # decided per machine at load: publish what is exact
        (["rollout.engine=vllm", "rollout.server.url=http://127.0.0.1:9", "rollout.server.dtype=bfloat16"], "bfloat16"),
        (["rollout.engine=sglang", "rollout.server.url=http://127.0.0.1:9", "rollout.dtype=bfloat16"], "float32"),
        (["train.weight_dtype=bfloat16"], "bfloat16"),
        (["rollout.dtype=bfloat16", "train.weight_dtype=float32"], "float32"),
    ],
)
def test_auto_publishes_what_the_engines_load(overrides, dtype):
    assert published_dtype(load_config(None, overrides)) == dtype


def test_bf16_versions_are_the_cast_master_and_their_deltas_rebuild_bit_exact(tmp_path):
    blobs = adamw_versions(6)
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        store = Store(str(tmp_path / dtype))
        pub = WeightPublisher(store, SIDE, delta=True, full_every=4, dtype=dtype)
        sizes[dtype] = []
        for v, blob in enumerate(blobs):
            pub.publish(v, blob)
            sizes[dtype].append(pub.last_weights_bytes)
            assert load_weights_bytes(store, v) == cast_safetensors(blob, dtype)
        master = st_load(blobs[5])
        loaded = load_state_dict(store, 5)
        for k, t in master.items():
            assert loaded[k].dtype == getattr(torch, dtype) and torch.equal(loaded[k], t.to(loaded[k].dtype)), k
        assert DELTA_FILE in store.read_json(LAYOUT.manifest(5))["files"]
    assert sizes["bfloat16"][0] < 0.55 * sizes["float32"][0]  # a full file: half, the header aside
    assert all(b < f for b, f in zip(sizes["bfloat16"][1:4], sizes["float32"][1:4]))  # deltas: smaller still


def test_a_float32_engine_loads_a_bf16_version_as_its_values(tmp_path):
    """An engine whose model is float32 installs a bf16 version as the bf16 values, exactly."""
    from areal_core.config import ModelConfig
    from areal_core.models import build_tiny_model
    from areal_core.rollout.torch_engine import TorchEngine

    blobs = adamw_versions(2)
    store = Store(str(tmp_path / "run"))
    WeightPublisher(store, SIDE, dtype="bfloat16").publish(1, blobs[1])
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    engine = TorchEngine(build_tiny_model(cfg, 50, 0), 0, 1)
    engine.receive(store, 1)
    engine.load_version(1)
    master = st_load(blobs[1])
    for k, t in engine.model.state_dict().items():
        if k in master:
            assert t.dtype == torch.float32 and torch.equal(t, master[k].to(torch.bfloat16).float()), k


@pytest.mark.slow
def test_smollm2_full_fine_tuning_at_lr_1e5_publishes_under_5_percent_of_a_bf16_file(tmp_path):
    """Five AdamW steps of SmolLM2-135M-Instruct at lr 1e-5 (benchmarks/weight_density.py's chain):
    each bf16 delta is at most 5% of a full bf16 file and rebuilds bit for bit."""
    from areal_core import pretrained
    from benchmarks.weight_density import measure
    from benchmarks.weight_transfer import pretrained_chain

    _, versions = pretrained_chain(str(pretrained.ensure("smollm2")), 1e-5, 5, 1, 4, seed=0)
    row = measure(Store(str(tmp_path / "run")), versions, "bfloat16")
    assert row["bit_exact"] and row["delta_frac_max"] <= 0.05, row
    assert 0 < row["density_median"] < 0.2, row
