"""One bad reader costs a reader, not the run (issue 54): a rollout worker that fails every load of
versions that verify in the store restarts its loader once, is then retired by the trainer, and
the other worker finishes the run with the whole admission."""

from __future__ import annotations

import pytest

from areal_core.events import read_events
from areal_core.layout import LAYOUT
from areal_core.report.doctor import diagnose
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from areal_core.weights.faults import retired_groups

# Imported at start-up by every process the launcher starts with this folder on PYTHONPATH; it acts
# in `rollout --index 1` only: that pod's reads of weight files come back with one bit flipped (a
# bad disk, memory or network on one machine), so every load fails its sha256 check there while
# the store itself holds good versions.
BAD_POD = """
import sys

argv = sys.argv
if "rollout" in argv and "--index" in argv and argv[argv.index("--index") + 1] == "1":
    from areal_core.store import Store

    _read_bytes = Store.read_bytes

    def read_bytes(self, rel, *args, **kwargs):
        data = _read_bytes(self, rel, *args, **kwargs)
        if rel.startswith("weights/v") and rel.endswith(".safetensors") and data:
            data = data[:-1] + bytes([data[-1] ^ 1])
        return data

    Store.read_bytes = read_bytes
"""


@pytest.mark.slow
def test_a_run_with_a_rollout_worker_that_fails_every_load_reaches_done(tiny_overrides, tmp_path, capsys):
    hook = tmp_path / "bad_pod"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BAD_POD)
    # η = 1: rollout-0's half of the admission holds 3 groups at v1 and the trainer needs 4 for its
    # third step, so the run finishes only once rollout-0 has rollout-1's share too
    overrides = [*tiny_overrides, "rollout.num_workers=2", "train.eta=1", "train.steps=4"]
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)
    store = Store(run_uri)
    result = launch(run_uri, 2, 1, timeout_s=600, progress=False, env={"PYTHONPATH": str(hook)})

    assert store.done() and result["step"] == 4
    restarts = [line for line in capsys.readouterr().err.splitlines() if "restarting the loader" in line]
    assert len(restarts) == 1 and restarts[0].startswith("[rollout-1]")  # once, before it was retired
    events = read_events(store)
    (retired,) = [e for e in events if e["kind"] == "reader_retired"]
    assert retired["reader"] == "rollout-1" and "sha256" in retired["error"]
    assert not [e for e in events if e["kind"] in ("republish", "version_unloadable")]  # the store was fine
    assert {e["worker"] for e in events if e["kind"] == "load" and e["role"] == "rollout"} == {"0"}
    assert retired_groups(store) == {"rollout-1": 0}  # it stopped holding no group
    assert not store.find(LAYOUT.shard_dir("ungraded", "rollout-1"), ".arrow")
    trained = [store.read_json(LAYOUT.trained_record(s)) for s in range(4)]
    assert all(sid.startswith("rollout-0-") for t in trained for sid, _ in t["samples"])
    assert sum(len(t["samples"]) for t in trained) == 4 * 2 * 4  # steps · B · G, all rollout-0's
    findings = {f.title: f for f in diagnose(events)}
    bad = findings["rollout-1 was taken out of the run"]
    assert bad.role == "rollout" and "verifies in the store" in bad.evidence and "sha256" in bad.evidence
