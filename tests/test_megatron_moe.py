"""Qwen3-MoE to megatron-core and back, and expert parallelism 2 on 2 gloo ranks (issue 55;
docs/megatron.md "Mixture of experts").

Without megatron-core: a tiny Qwen3-MoE (transformers' own class) converts HF → Megatron → EP 2
shards → HF byte for byte, each rank holds its half of the experts, renumbered. In the megatron
venv (scripts/setup_megatron_venv.sh; skipped, saying so, without it): the EP shards fit
megatron-core's GPTModel with `expert_model_parallel_size=2` key for key and shape for shape, the
two ranks' own state dicts unshard and convert back to the HF checkpoint byte for byte, and the
forward (whole model, and layer 0's MoE layer alone) either equals HF (max |Δ| < 1e-4, float32)
or stops at the CUDA-only calls docs/megatron.md names.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.megatron.moe import (
    ep_case,
    megatron_to_qwen3_moe,
    moe_shape_from_hf_config,
    qwen3_moe_to_megatron,
    shard_experts,
    unshard_experts,
)
from benchmarks import tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("AREAL_MEGATRON_VENV", ROOT / ".venv-megatron"))
# megatron-core 0.16.1 on a CPU-only torch: where the whole forward and the MoE layer alone stop
FORWARD_STOP = "megatron/core/models/common/embeddings/rotary_pos_embedding.py:162 in get_emb"
MOE_LAYER_STOP = "megatron/core/transformer/moe/router.py:90 in gating"
TOLERANCE = 1e-4  # float32, max |Δ| over logits / MoE outputs, were the forward to run


@pytest.fixture(scope="module")
def qwen3_moe() -> torch.nn.Module:
    return tiny_checkpoints.model("qwen3_moe")


def test_qwen3_moe_round_trips_through_megatron_and_ep2_shards_byte_for_byte(qwen3_moe):
    shape, moe = moe_shape_from_hf_config(qwen3_moe.config)
    hf = qwen3_moe.state_dict()
    mg = qwen3_moe_to_megatron(hf, shape, moe)
    fc1 = hf["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(mg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"], fc1[3])
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    parts = [shard_experts(mg, 2, rank, moe) for rank in range(2)]
    # rank 1 holds global experts 2 and 3 as its local experts 0 and 1
    assert torch.equal(parts[1]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"], fc1[3])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in parts[0]
    back = megatron_to_qwen3_moe(unshard_experts(parts), shape, moe)
    assert st_save(back) == st_save({k: v.contiguous() for k, v in hf.items()})


def test_the_converter_refuses_what_it_does_not_map(qwen3_moe):
    shape, moe = moe_shape_from_hf_config(qwen3_moe.config)
    with pytest.raises(ValueError, match="expert parallel 3"):
        shard_experts(qwen3_moe_to_megatron(qwen3_moe.state_dict(), shape, moe), 3, 0, moe)
    with pytest.raises(ValueError, match="qwen3_moe only"):
        moe_shape_from_hf_config({"model_type": "qwen2_moe"})


@pytest.mark.slow
@pytest.mark.skipif(
    not (VENV / ".installed-megatron-core-0.16.1").exists(),
    reason=f"no megatron-core 0.16.1 venv at {VENV} (scripts/setup_megatron_venv.sh builds it)",
)
def test_megatron_core_ep2_forward_equals_hf_or_stops_at_the_documented_cuda_calls(qwen3_moe, tmp_path):
    shape, moe = moe_shape_from_hf_config(qwen3_moe.config)
    ids = torch.randint(0, shape.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.save(ep_case(qwen3_moe, ids), tmp_path / "case.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [str(VENV / "bin/python"), "-m", "areal_core.megatron.ep_check", str(tmp_path / "case.pt"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "ep_check.json").read_text())
    assert result["mismatches"] == [] and result["_versions"]["megatron-core"] == "0.16.1"
    for part, stop in (("forward", FORWARD_STOP), ("moe_layer", MOE_LAYER_STOP)):
        if "max_abs_diff" in result[part]:
            assert result[part]["max_abs_diff"] < TOLERANCE, result
        else:  # a changed place means docs/megatron.md and these constants need updating
            assert result[part]["stopped"]["where"] == stop, result
            assert "Torch not compiled with CUDA enabled" in result[part]["stopped"]["error"]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert len([k for k in ranks[1] if ".local_experts." in k]) == 2 * shape.num_layers * 2  # 2 experts, fc1 + fc2
    back = megatron_to_qwen3_moe(unshard_experts(ranks), shape, moe)
    assert st_save(back) == st_save({k: v.contiguous() for k, v in qwen3_moe.state_dict().items()})
