"""benchmarks/gpu_smoke.py's CPU fallback, so that the script is ready (and correct) the day a GPU
is lent: every section runs and reports its figures; vLLM is skipped with its reason on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_smoke_script_runs_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "benchmarks/gpu_smoke.py", "--device", "cpu", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in figures.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert figures["env"]["device"] == "cpu" and figures["trainer"]["tokens_per_s"] > 0
    assert figures["trainer"]["mfu"] is None  # no peak to compare with on a CPU
    engines = figures["engines"]
    assert all(engines[k]["tok_s"] > 0 for k in ("transformers_generate", "torch_engine", "continuous_engine"))
    assert "device=cuda" in figures["vllm"]["skipped"]
    assert figures["rl"]["steps"] == 3 and figures["rl"]["s_per_step"] > 0
    real = figures["real_vocab"]  # issue 44: the real vocabulary and long rows through the trainer
    assert set(real) - {"section_s"} == {"tiny_2x256", "tiny_2x1k"}
    assert all(real[k]["vocab"] == 151936 and real[k]["tokens_per_s"] > 0 for k in ("tiny_2x256", "tiny_2x1k"))
    assert real["tiny_2x1k"]["tokens"] == 2 * (32 + 1024) and "mfu" not in real["tiny_2x1k"]
