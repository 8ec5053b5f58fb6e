"""A reward function that fails at run time is visible and stops what cannot train: the share of failed
calls is a metric, the doctor names it with its reason, a run whose first groups' rewards all failed
stops with that reason, and the report of a crashed run leads with the crash."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from areal_core.layout import LAYOUT
from areal_core.report.doctor import crashes, diagnose
from areal_core.run import pipeline
from areal_core.run.launcher import RoleFailed, launch
from areal_core.store import Store
from tests.conftest import ROOT, TINY

HERE = "tests.test_reward_failures"


def fails_at_run_time(completion: str, reference: str) -> float:
    """Binds, and passes prepare's probe (the reference answer itself); every generated completion
    (at most 8 tokens, shorter than any reference) fails."""
    if completion == reference:
        return 1.0
    raise KeyError("lookup table has no entry for this completion")


def fails_half(completion: str) -> float:
    if len(completion) % 2:
        raise ValueError("odd length")
    return 1.0


def prepared(tmp_path, reward: str, *extra: str) -> str:
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", f"reward.function={HERE}:{reward}", *extra])
    pipeline.sft(run_uri)
    return run_uri


@pytest.mark.slow
def test_a_run_whose_rewards_all_fail_stops_with_the_reason_and_its_report_leads_with_it(tmp_path):
    run_uri = prepared(tmp_path, "fails_at_run_time")
    with pytest.raises(RoleFailed, match="role reward-0 exited"):
        launch(run_uri, 1, 1, timeout_s=300, progress=False)
    store = Store(run_uri)
    assert not store.done()
    out = subprocess.run(
        [sys.executable, "-m", "areal_core.report", run_uri, "-o", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    first = out.stdout.splitlines()[0]
    assert re.match(r"the run crashed: reward-0 failed: RewardFunctionFailing: every one of the first (\d+) ", first)
    assert int(re.match(r".* the first (\d+) ", first).group(1)) >= 16  # 4 groups of 4
    assert "fails_at_run_time" in first and "KeyError" in first and "lookup table" in first


@pytest.mark.slow
def test_a_reward_that_fails_for_half_the_samples_is_a_metric_and_a_doctor_finding(tmp_path):
    run_uri = prepared(tmp_path, "fails_half")
    launch(run_uri, 1, 1, timeout_s=300, progress=False)
    store = Store(run_uri)
    assert store.done()
    rows = [json.loads(x) for x in store.read_text(LAYOUT.metrics).splitlines() if x]
    fracs = [r["reward_error_frac"] for r in rows]
    assert all(0 < f < 1 for f in fracs[:1]) and 0.2 < sum(fracs) / len(fracs) < 0.8
    from areal_core.report.data import load_run

    data = load_run(store)
    [finding] = [f for f in diagnose(data.records, data.rows) if "rewards are errors" in f.title]
    assert "ValueError: odd length" in finding.evidence


def test_a_role_killed_without_a_word_is_named_by_its_exit_code_and_last_line():
    at = {"t": 1.0, "role": "launcher", "worker": "0"}  # as events.read_records gives them
    records = [{**at, "kind": "crash", "name": "rollout-1", "exit_code": -9, "last_line": "generating batch 7"}]
    [f] = crashes(records)
    assert f.title == "the run crashed: rollout-1 exited with code -9"
    assert "generating batch 7" in f.evidence and "SIGKILL" in f.advice
    own = {**at, "role": "rollout", "worker": "1", "kind": "crash", "name": "rollout-1", "error": "MemoryError: "}
    assert [f.title for f in crashes([*records, own])] == ["the run crashed: rollout-1 failed"]
    assert diagnose([*records, own])[0].title == "the run crashed: rollout-1 failed"


def test_mlflow_artifacts_go_beside_the_users_sqlite_store_not_into_the_working_directory(tmp_path, monkeypatch):
    from areal_core.config import load_config
    from areal_core.run.tracking import Tracker

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    db = tmp_path / "tracking" / "mine.db"
    cfg = load_config(None, [f"store={tmp_path / 'run'}", f"tracking.uri=sqlite:///{db}", "tracking.experiment=own"])
    store = Store(cfg.store)
    tracker = Tracker.create(store, cfg)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"x" * 10)
    tracker.log_artifacts(folder, "final_model")
    tracker.finish("FINISHED")
    assert list((db.parent / "mlartifacts").rglob("weights.bin"))
    assert not list(work.rglob("*"))  # nothing in the working directory
