"""Replay (areal_core/run/replay.py): a run's stored samples trained again in their recorded
order reproduce the run's per-step loss and grad-norm; other settings apply; bad requests are
refused in one line and write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from areal_core.layout import LAYOUT
from areal_core.run import pipeline
from areal_core.run.derived import DerivedRunError
from areal_core.run.replay import record_ids, replay
from areal_core.store import Store
from areal_core.train import borrowed_threads
from tests.conftest import ROOT, TINY
from tests.test_regrade import kill_when

STEPS = 6


def records(store: Store) -> list[dict]:
    return [store.read_json(LAYOUT.trained_record(s)) for s in range(STEPS)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Store:
    """A short asynchronous run (η = 2, one rollout and one reward worker) to DONE, its trainer borrowing idle cores
    (the thread count of every layer pass recorded)."""
    root = tmp_path_factory.mktemp("replay") / "run"
    signal = ["reward.function=tests.test_pipeline:hash_reward", "rollout.temperature=1.5"]  # mixed groups
    args = [*TINY, f"store={root}", f"train.steps={STEPS}", "train.lr=3e-3", "train.borrow_idle_cores=1", *signal]
    run_uri, _ = pipeline.prepare("", args)
    pipeline.run_async_rl(run_uri, pipeline.sft(run_uri))
    store = Store(run_uri)
    assert store.done()
    return store


@pytest.mark.slow
def test_replay_reproduces_the_runs_loss_and_grad_norm_step_for_step(source, tmp_path, monkeypatch):
    monkeypatch.setattr(borrowed_threads, "others_running", lambda: 99)  # live choices would all be 1 thread
    out = replay(source.uri, str(tmp_path / "replay"))
    dst = Store(str(tmp_path / "replay"))
    run, again = records(source), records(dst)
    trained = [r for r in run if r["metrics"]["grad_norm"] > 0]
    assert len(trained) >= 2, "the run must have learned something for the comparison to mean anything"
    for a, b in zip(run, again):
        assert record_ids(b) == record_ids(a) and len(record_ids(a)) == 8  # same samples, same order
        assert b["trainer_version"] == a["trainer_version"]
        # the thread count of every layer pass, and the replay ran each pass at it (not at the machine's: 1 thread)
        assert len(a["threads"]) >= 2 and set(a["threads"]) <= {1, 2}
        assert b["threads"] == a["threads"]
        for key in ("loss", "grad_norm", "reward_mean", "kl_behav_prox", "importance_weight_mean"):
            x, y = a["metrics"][key], b["metrics"][key]
            assert abs(x - y) <= 1e-5 * max(abs(x), 1e-12), (a["step"], key, x, y)
    assert out["max_rel_diff"]["loss"] <= 1e-5 and out["max_rel_diff"]["grad_norm"] <= 1e-5
    assert dst.read_json(LAYOUT.replay_record)["state"] == "done" and dst.done()
    assert dst.exists(LAYOUT.committed(LAYOUT.final_model))
    assert not dst.find(LAYOUT.weights_root) and not dst.find(LAYOUT.checkpoints_dir)  # nothing published
    # the run's own metrics file (rounded to 4 digits) says the same
    rows = [json.loads(line) for line in source.read_text(LAYOUT.metrics).splitlines()]
    assert [round(s["grad_norm"], 4) for s in out["per_step"]] == [r["grad_norm"] for r in rows]


@pytest.mark.slow
def test_a_replay_runs_each_layer_pass_at_the_recorded_thread_count(source, tmp_path, monkeypatch):
    """The run's records say which passes ran on 2 threads; the replay follows them (the machine, patched to busy,
    would say 1 everywhere), also under a config that would not borrow."""
    run = Store(str(tmp_path / "run"))
    shutil.copytree(source.local_path(), tmp_path / "run")
    pattern = {}
    for rec in records(run):
        rec["threads"] = pattern[rec["step"]] = [1 + (i + rec["step"]) % 2 for i in range(len(rec["threads"]))]
        run.write_json(LAYOUT.trained_record(rec["step"]), rec)
    monkeypatch.setattr(borrowed_threads, "others_running", lambda: 99)
    for name, overrides in (("same", []), ("off", ["train.borrow_idle_cores=0"])):
        out = replay(run.uri, str(tmp_path / name), overrides)
        assert {r["step"]: r["threads"] for r in records(Store(str(tmp_path / name)))} == pattern, name
        assert out["max_rel_diff"]["loss"] <= 1e-5 and out["max_rel_diff"]["grad_norm"] <= 1e-5


@pytest.mark.slow
def test_replay_under_other_settings_trains_the_same_samples_differently(source, tmp_path):
    out = replay(source.uri, str(tmp_path / "lr"), ["train.lr=1e-4"])
    run, steps = records(source), out["per_step"]
    # step 0 starts from the same weights: same loss; once a step moved the weights, they differ
    assert steps[0]["loss"] == run[0]["metrics"]["loss"]
    first = next(i for i, r in enumerate(run) if r["metrics"]["grad_norm"] > 0)
    later = [s for s in steps[first + 1 :] if s["run_grad_norm"] > 0]
    assert later and all(s["grad_norm"] != s["run_grad_norm"] for s in later)
    # η = 0 drops the recorded samples that are stale under it (counted), trains the rest
    strict = replay(source.uri, str(tmp_path / "eta0"), ["train.eta=0", "algo.loss=gspo"])
    dst = Store(str(tmp_path / "eta0"))
    assert dst.read_json(LAYOUT.done)["counters"]["dropped_samples"] == sum(map(dropped_at_eta0, run)) > 0
    assert len(strict["per_step"]) + len(strict["skipped"]) == STEPS


def dropped_at_eta0(rec: dict) -> int:
    """Samples of a recorded step that η = 0 drops: those older than the step's version, and the
    rest of a group left with fewer than two."""
    groups: dict[str, list[bool]] = {}
    for sid, version in rec["samples"]:
        groups.setdefault(sid.rsplit("-", 1)[0], []).append(version >= rec["trainer_version"])
    return sum(len(fresh) if sum(fresh) < 2 else fresh.count(False) for fresh in groups.values())


@pytest.mark.slow
def test_bad_replays_are_refused_in_one_line_and_write_nothing(source, tmp_path):
    into = tmp_path / "new"
    with pytest.raises(DerivedRunError, match=r"cannot change model.hidden_size"):
        replay(source.uri, str(into), ["model.hidden_size=64"])
    with pytest.raises(DerivedRunError, match=r"rollout.temperature"):
        replay(source.uri, str(into), ["rollout.temperature=0.5"])
    with pytest.raises(DerivedRunError, match="source run's own root"):
        replay(source.uri, source.uri)
    with pytest.raises(DerivedRunError, match="source run's own root"):
        replay(source.uri, f"{into}/../../{source.local_path().parent.name}/run")
    with pytest.raises(DerivedRunError, match="unknown config key 'algo.nosuch'"):
        replay(source.uri, str(into), ["algo.nosuch=1"])
    assert not into.exists()
    (into / "x").mkdir(parents=True)
    (into / "x" / "f").write_text("mine")
    with pytest.raises(DerivedRunError, match="already holds"):
        replay(source.uri, str(into))
    assert (into / "x" / "f").read_text() == "mine"
    # a trained sample missing from the stored shards is named
    copy = tmp_path / "copy"
    shutil.copytree(source.local_path(), copy)
    Store(str(copy)).delete(Store(str(copy)).find(LAYOUT.graded_dir, ".arrow")[0])
    with pytest.raises(DerivedRunError, match="not in its layer .graded."):
        replay(str(copy), str(tmp_path / "r2"))
    assert not (tmp_path / "r2").exists()
    # the command line: exit code 2 and one line
    cli = subprocess.run(
        [sys.executable, "-m", "areal_core.run.replay", source.uri, "--into", str(into), "--set", "task.name=gsm8k"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stderr.strip().count("\n") == 0 and "replay:" in cli.stderr


# a replay that trains two steps, then hangs in the third until it is killed
HANGS_AT_STEP_2 = """
import sys, time, areal_core.run.replay as r
from areal_core.train.trainer import Trainer
real = Trainer.step
def step(self, *args):
    if self.state.step >= 2:
        time.sleep(600)
    return real(self, *args)
Trainer.step = step
sys.exit(r.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_replay_killed_midway_is_redone_by_its_retry(source, tmp_path):
    """A replay SIGKILLed after two steps: the retried task (the same request) trains again from
    the start into the same root and reproduces the run; a retry of the finished replay returns its
    result; another request into that root is refused."""
    into = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [source.uri, "--into", str(into), "--set", "train.lr=3e-3"]
    proc = subprocess.Popen([sys.executable, "-c", HANGS_AT_STEP_2, *argv], cwd=ROOT, env=env, start_new_session=True)
    dst = Store(str(into))
    kill_when(proc, lambda: dst.exists(LAYOUT.trained_record(1)))
    assert not dst.done() and not dst.exists(LAYOUT.derived_result)
    out = replay(source.uri, str(into), ["train.lr=3e-3"])
    assert out["max_rel_diff"]["loss"] <= 1e-5 and out["max_rel_diff"]["grad_norm"] <= 1e-5
    assert [record_ids(r) for r in records(dst)] == [record_ids(r) for r in records(source)]
    assert len(dst.read_text(LAYOUT.metrics).splitlines()) == STEPS  # the dead attempt's rows are gone
    assert dst.done() and dst.read_json(LAYOUT.replay_record)["state"] == "done"
    assert replay(source.uri, str(into), ["train.lr=3e-3"]) == out
    with pytest.raises(DerivedRunError, match="another request"):
        replay(source.uri, str(into), ["train.lr=1e-4"])
    with pytest.raises(DerivedRunError, match="another request"):
        replay(source.uri, str(into), ["train.lr=3e-3"], layer="fixed")
