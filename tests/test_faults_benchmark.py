"""benchmarks/faults.py as a test (issue 46): the online loop under every fault at once loses no
row, trains none twice, promotes nothing wrongly, leaks no process and admits no duplicate writer;
the damaged versions are repaired by the trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_online_loop_under_every_fault_loses_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/faults.py", "--root", str(tmp_path), "--out", str(tmp_path / "faults.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
    detail = json.loads((tmp_path / "faults.json").read_text())
    assert result["done"] is True, detail
    assert (result["lost"], result["trained_twice"], result["wrong_promotions"], result["leaked_processes"]) == (
        0,
        0,
        0,
        0,
    ), detail
    assert result["duplicate_writer_refused"] is True and result["dropped_twice"] == 0
    assert len(detail["faults"]["flipped_versions"]) == 2 and detail["faults"]["registry_up_after_offer"] > 0
    assert detail["rows"]["written"] > detail["rows"]["trained"] > 0
    assert detail["mcp"]["episodes_failed"] == 0 and detail["mcp"]["noise_lines"] == {"noisy": 10000}
