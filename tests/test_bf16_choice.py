"""bf16 where it is fast: `auto` picks bfloat16 on accelerators and on CPUs with avx512_bf16 or AMX,
float32 on AVX2-only CPUs (which emulate bf16 matmuls: the SmolLM2 config's first LoRA step took
minutes on such an EPYC), for the rollout engines' weights and the trainer's autocast alike."""

from __future__ import annotations

import pytest
import torch

from areal_core.config import ConfigError, load_config
from areal_core.config.device import cpu_flags, fast_bf16, use_bf16

XEON = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
EPYC_AVX2 = {"avx2", "fma", "sse4_2"}


@pytest.mark.parametrize(
    ("choice", "device", "flags", "expected"),
    [
        ("auto", "cpu", XEON, True),
        ("auto", "cpu", {"avx2", "avx512_bf16"}, True),
        ("auto", "cpu", {"avx2", "amx_bf16"}, True),
        ("auto", "cpu", EPYC_AVX2, False),
        ("auto", "cpu", {"avx2", "avx512f"}, False),  # AVX-512 without its bf16 extension
        ("auto", "cpu", set(), False),  # flags unreadable: the safe choice
        ("auto", "cuda", EPYC_AVX2, True),
        ("auto", "npu", set(), True),
        (True, "cpu", EPYC_AVX2, True),  # an explicit choice is kept
        (False, "cpu", XEON, False),
    ],
)
def test_use_bf16(choice, device, flags, expected):
    assert use_bf16(choice, device, flags) is expected


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "fma"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
    assert fast_bf16("cpu", cpu_flags(str(info))) is False


def test_auto_is_accepted_for_both_and_other_words_are_refused():
    cfg = load_config(None, ["rollout.dtype=auto", "train.bf16_autocast=auto"])
    assert (cfg.rollout.dtype, cfg.train.bf16_autocast) == ("auto", "auto")
    for bad in ("rollout.dtype=fp8", "train.bf16_autocast=sometimes"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])


def test_the_rollout_engine_and_the_trainer_follow_the_machine(monkeypatch):
    from areal_core.rollout import factory

    cfg = load_config(None, ["rollout.dtype=auto"])
    monkeypatch.setattr("areal_core.config.device.cpu_flags", lambda: EPYC_AVX2)
    assert factory.rollout_dtype(cfg) == torch.float32
    monkeypatch.setattr("areal_core.config.device.cpu_flags", lambda: XEON)
    assert factory.rollout_dtype(cfg) == torch.bfloat16
    assert factory.rollout_dtype(load_config(None, ["rollout.dtype=float32"])) == torch.float32
    assert factory.rollout_dtype(load_config(None, ["rollout.dtype=bfloat16"])) == torch.bfloat16


def test_the_smollm2_config_samples_in_float32_and_picks_the_engine_by_architecture():
    """docs/architectures.md: a bfloat16 engine's log-probs are not the trainer's, so the shipped
    config samples in float32; the trainer's autocast still chooses by machine."""
    cfg = load_config("configs/smollm2_arithmetic.yaml", [])
    assert (cfg.rollout.dtype, cfg.rollout.engine, cfg.train.bf16_autocast) == ("float32", "auto", "auto")
