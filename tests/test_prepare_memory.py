"""Prepare holds one copy of a checkpoint's weights (run/prepare_memory.py): its peak resident set,
measured in a fresh process, grows by less than 1.6 times the checkpoint's float32 size (it grew by
three copies when the LoRA check and the agreement's engine each took a deep copy), and the prepare
pod of configs/cluster.yaml is sized by the formula docs/cluster.md gives."""

from __future__ import annotations

import pytest
import torch
import yaml

from areal_core.config.pod_memory import (
    PREPARE_RAM_BASE_BYTES,
    PREPARE_RAM_HEADROOM,
    PREPARE_RAM_PER_WEIGHT_BYTE,
    prepare_memory_bytes,
    quantity_bytes,
)
from areal_core.run import preflight
from areal_core.run.prepare_memory import cast_copy, meta_copy
from benchmarks import tiny_checkpoints as tc
from benchmarks.prepare_memory import float32_weight_bytes, measure, tiny_llama
from tests.conftest import ROOT


@pytest.mark.slow
def test_prepare_holds_one_copy_of_the_weights(tmp_path):
    """A 97 MiB Llama (float32), LoRA on, the torch engine's agreement check: prepare's peak RSS
    grows by under 1.6x the weights (one copy, the forward's activations and the task's rows); a
    warm-up prepare on a 0.3 MiB checkpoint first, so imports and first-use caches are not counted."""
    ckpt = tiny_llama(tmp_path / "llama")
    warm = tc.save("llama", tmp_path / "warm")
    got = measure(ckpt, ["rollout.engine=torch", "rollout.dtype=float32"], warmup=warm)
    weights = float32_weight_bytes(ckpt) / 2**20
    assert 90 < weights < 110
    assert got["growth_mb"] < 1.6 * weights, got


def test_a_float32_engine_runs_the_loaded_model_and_a_bfloat16_one_a_cast_copy():
    model = tc.model("qwen2")  # tied embeddings
    assert preflight.engine_weights(model, torch.float32) is model
    half = preflight.engine_weights(model, torch.bfloat16)
    reference = tc.model("qwen2").to(torch.bfloat16)
    assert half.lm_head.weight is half.get_input_embeddings().weight
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    for (name, a), (_, b) in zip(half.state_dict().items(), reference.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the loaded model is untouched


def test_the_lora_check_works_on_a_weightless_copy():
    model = tc.model("llama")
    skeleton = meta_copy(model)
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert [(n, p.shape) for n, p in skeleton.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]
    assert cast_copy(model, torch.bfloat16).model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_the_formula_is_a_line_in_the_weights():
    """headroom · (a·W + b), whole MiB: b alone for a checkpoint checked on the meta device."""
    assert prepare_memory_bytes(0) == pytest.approx(PREPARE_RAM_HEADROOM * PREPARE_RAM_BASE_BYTES, abs=2**20)
    w = 2**30
    want = PREPARE_RAM_HEADROOM * (PREPARE_RAM_PER_WEIGHT_BYTE * w + PREPARE_RAM_BASE_BYTES)
    assert 0 <= prepare_memory_bytes(w) - want < 2**20
    assert prepare_memory_bytes(1000, per_weight_byte=1.0, base_bytes=0, headroom=1.0) == 2**20
    assert [quantity_bytes(q) for q in ("6Gi", "512Mi", "1G", "1500")] == [6 * 2**30, 2**29, 10**9, 1500]


def test_the_cluster_config_sizes_the_prepare_pod_by_the_formula():
    """configs/cluster.yaml's prepare pod requests what the formula gives for the largest checkpoint
    prepare loads: MAX_WEIGHT_BYTES of half-precision files, twice that in float32 (rounded up to a
    whole GiB, at most 1 GiB over); its limit is the request."""
    from areal_core.config.cluster import ClusterConfig, load_cluster_config

    pod = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())["prepare"]
    need = prepare_memory_bytes(2 * preflight.MAX_WEIGHT_BYTES)
    request = quantity_bytes(pod["requests"]["mem"])
    assert need <= request < need + 2**30
    assert pod["limits"]["mem"] == pod["requests"]["mem"]
    assert load_cluster_config(ROOT / "configs" / "cluster.yaml").prepare.requests["mem"] == pod["requests"]["mem"]
    assert quantity_bytes(ClusterConfig().prepare.requests["mem"]) >= need  # the default, without the file


def test_a_remote_checkpoint_is_loaded_from_a_download_removed_after(s3_bucket, tmp_path, monkeypatch):
    """A checkpoint in a bucket, under MAX_WEIGHT_BYTES: prepare downloads it, loads it and removes
    the download (the pod's disk held a second copy of every checkpoint it checked)."""
    import tempfile

    from areal_core.store import Store

    local = tc.save("llama", tmp_path / "llama")
    Store(f"{s3_bucket}/llama").put_dir(str(local), "")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    model, tokenizer, loaded = preflight.load_for_checks(f"{s3_bucket}/llama")
    assert loaded and tokenizer is not None
    want = tc.model("llama").state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert list(scratch.iterdir()) == []
