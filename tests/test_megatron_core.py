"""megatron-core itself on CPU (docs/megatron.md): the converted tiny Qwen2 (q/k/v biases, untied)
and Llama (tied, head_dim != hidden / heads) fit megatron-core's GPTModel (local layer spec) key
for key and shape for shape at TP 1 and TP 2 on 2 gloo ranks; the TP 2 GPTModels' own state
dicts gather to rank 0 and convert back to the HF checkpoint byte for byte, which publishes and
loads unchanged; the forward either equals the HF logits or stops at the one CUDA call the
docs name.

megatron-core runs in its own venv (scripts/setup_megatron_venv.sh; .ci/run builds it), driven
through `python -m areal_core.megatron.selfcheck` and files; without that venv these tests skip,
saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.megatron.convert import hf_to_megatron
from areal_core.megatron.publish import hf_weights_bytes
from areal_core.megatron.shapes import shape_from_hf_config
from areal_core.store import Store
from areal_core.weights.publisher import hf_side_files, publish
from tests.test_megatron_convert import expected_hf, hf_logits, ids_batch, tiny_model
from tests.test_megatron_publish import loads_unchanged

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("AREAL_MEGATRON_VENV", ROOT / ".venv-megatron"))
MEGATRON_PY = VENV / "bin" / "python"
FAMILIES = ("qwen2", "llama")
# Where megatron-core 0.16.1's GPTModel forward stops on a CPU-only torch (the first CUDA call).
CPU_STOP = {
    "where": "megatron/core/models/common/embeddings/rotary_pos_embedding.py:162 in get_emb",
    "code": "self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())",
    "error": "AssertionError: Torch not compiled with CUDA enabled",
}

pytestmark = pytest.mark.skipif(
    not (VENV / ".installed-megatron-core-0.16.1").exists(),  # the stamp of a finished install
    reason=f"no megatron-core 0.16.1 venv at {VENV} (scripts/setup_megatron_venv.sh builds it)",
)


@pytest.fixture(scope="module")
def selfcheck(tmp_path_factory) -> tuple[dict, Path, dict]:
    """(selfcheck.json, its folder, {family: HF model}) of one selfcheck run over both families."""
    tmp = tmp_path_factory.mktemp("megatron")
    models, cases = {}, []
    for family in FAMILIES:
        model = models[family] = tiny_model(family)
        shape = shape_from_hf_config(model.config)
        ids = ids_batch()
        mg = hf_to_megatron(model.state_dict(), shape)
        case = {"name": family, "shape": shape.as_dict(), "megatron": mg, "ids": ids}
        cases.append({**case, "hf_logits": hf_logits(model, ids)})
    torch.save(cases, tmp / "cases.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [str(MEGATRON_PY), "-m", "areal_core.megatron.selfcheck", str(tmp / "cases.pt"), str(tmp / "out")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out" / "selfcheck.json").read_text()), tmp / "out", models


def test_converted_weights_fit_megatrons_gptmodel_at_tp1_and_tp2(selfcheck):
    result, _, _ = selfcheck
    print("selfcheck:", json.dumps(result), file=sys.stderr)
    assert result["_versions"]["megatron-core"] == "0.16.1"
    for family in FAMILIES:
        assert result[family]["tp1"]["mismatches"] == [] and result[family]["tp2"]["mismatches"] == []


def test_the_cpu_forward_equals_hf_or_stops_at_the_documented_cuda_call(selfcheck):
    result, _, _ = selfcheck
    for family in FAMILIES:
        for tp in ("tp1", "tp2"):
            r = result[family][tp]
            if "max_abs_diff" in r:
                assert r["max_abs_diff"] < 1e-4, (family, tp, r)
            elif "stopped" in r:  # a changed call means docs/megatron.md and CPU_STOP need updating
                assert r["stopped"] == CPU_STOP, (family, tp, r)
            else:  # TP 2 is not tried once TP 1 stopped
                assert tp == "tp2" and "stopped" in result[family]["tp1"], (family, tp, r)


def test_tp2_gptmodel_state_dicts_gather_to_the_hf_checkpoint_and_publish(selfcheck, tmp_path):
    _, out, models = selfcheck
    for family, model in models.items():
        hf = torch.load(out / f"{family}.hf.pt", weights_only=True)
        assert st_save(hf) == st_save(expected_hf(model))
        store = Store(str(tmp_path / family))
        publish(store, 1, hf_weights_bytes(hf), hf_side_files(model, None))
        loads_unchanged(store, model, tmp_path / f"{family}-staging")
