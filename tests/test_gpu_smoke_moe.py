"""benchmarks/gpu_smoke_moe.py (issue 55), the MoE sections of the GPU smoke run, on their CPU
path: the trainer's tokens/s over a tiny Qwen3-MoE and its active-parameter count, both engines'
tokens/s, and the megatron-core EP 2 call (in the megatron venv, skipped with its reason without)."""

from __future__ import annotations

import pytest

from benchmarks import gpu_smoke_moe as moe


def test_active_params_count_k_of_e_experts():
    # N_active = N_total - N_experts * (1 - k/E): 1,000 shared + 8/128 of 16,000 expert parameters
    assert moe.active_params(17_000, 16_000, 8, 128) == 2_000


def test_qwen3_30b_a3b_scaled_shape_keeps_the_experts_routing_and_ratio():
    shape = moe.QWEN3_30B_A3B_SCALED
    assert (shape["num_experts"], shape["num_experts_per_tok"]) == (128, 8)
    assert shape["hidden_size"] / shape["moe_intermediate_size"] == 2048 / 768


def test_the_moe_trainer_section_runs_on_cpu():
    figures = moe.moe_trainer("cpu", tiny=True, peak_tflops=989.0)
    assert figures["tokens_per_s"] > 0 and figures["mfu"] is None  # no peak to compare with on a CPU
    shape = moe.TINY_MOE
    experts = shape["num_hidden_layers"] * shape["num_experts"] * 3 * shape["hidden_size"] * 24
    assert figures["params"] - figures["active_params"] == experts * (1 - 4 / 16)


def test_the_moe_engines_section_runs_on_cpu():
    figures = moe.moe_engines("cpu", tiny=True)
    assert figures["torch_engine"]["tok_s"] > 0 and figures["continuous_engine"]["tok_s"] > 0


@pytest.mark.slow
def test_the_megatron_ep_section_records_the_call_or_why_it_skipped():
    figures = moe.megatron_ep("cpu")
    if moe.megatron_python() is None:
        assert "setup_megatron_venv.sh" in figures["skipped"]
    else:
        assert figures["mismatches"] == [] and "ep_check" in figures["call"], figures
        assert figures["moe_layer"].get("stopped", {}).get("where", "").startswith("megatron/core/transformer/moe/")
