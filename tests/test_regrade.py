"""Re-grading a finished run into a new layer through the reward pool, locally and on S3."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_core.dataset import open_run, samples_table
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard, encode_shard
from areal_core.reward.math import gsm8k_reward
from areal_core.reward.regrade import RegradeError, regrade
from areal_core.reward.regrade import main as regrade_cli
from areal_core.store import Store
from tests.conftest import ROOT
from tests.finished_run import finished_run

PARITY = "tests.test_regrade:parity"


def parity(completion: str, reference: str, prompt_id: str) -> float:
    """The run's reward (gsm8k) flipped on prompts with an even number: a changed reward whose
    changes are known in advance."""
    r = gsm8k_reward(completion, reference)
    return 1.0 - r if even(prompt_id) else r


def even(prompt_id: str) -> bool:
    return int(prompt_id.rsplit("-", 1)[1]) % 2 == 0


def digest(store: Store, folder: str) -> dict[str, str]:
    return {p: hashlib.sha256(store.read_bytes(p)).hexdigest() for p in store.find(folder)}


def copy_run(src: Store, dst: Store) -> Store:
    for folder in (LAYOUT.graded_dir, LAYOUT.trained_dir, LAYOUT.prompts_dir, LAYOUT.init_model):
        dst.copy_dir(folder, folder, source=src)
    dst.write_bytes(LAYOUT.config, src.read_bytes(LAYOUT.config))
    return dst


def check_parity_regrade(store: Store, into: str, report) -> None:
    """Exactly the samples of even prompts changed (1 − old), every other column is the same,
    and the original layer is untouched."""
    old = {(r["worker_id"], r["sample_id"]): r for r in samples_table(store, tokens=True).to_pylist()}
    new = {(r["worker_id"], r["sample_id"]): r for r in samples_table(store, into, tokens=True).to_pylist()}
    assert old.keys() == new.keys() and len(old) == report.samples > 0
    expected = {k for k, r in old.items() if even(r["prompt_id"])}
    changed = {(c["worker_id"], c["sample_id"]) for c in report.changes}
    assert changed == expected and report.changed == len(expected) and 0 < len(expected) < len(old)
    for k, r in old.items():
        assert new[k]["reward"] == (1.0 - r["reward"] if k in expected else r["reward"])
        same = ("input_ids", "behav_logprobs", "versions", "loss_mask", "shard_seq", "row", "status", "step")
        assert all(new[k][c] == r[c] for c in same)
    changes = pq.read_table(pa.BufferReader(store.read_bytes(LAYOUT.regrade_changes(into))))
    assert sorted(changes["identity"].to_pylist()) == sorted(f"{w}/{s}" for w, s in expected)
    record = store.read_json(LAYOUT.regrade_record(into))
    assert record["state"] == "committed" and record["changed"] == len(expected) and record["reward"] == PARITY


@pytest.mark.slow
def test_regrade_changes_exactly_the_rewards_it_should_and_leaves_the_original_intact():
    run_uri, _ = finished_run()
    store = Store(run_uri)
    before = digest(store, LAYOUT.graded_dir)
    report = regrade(run_uri, reward=PARITY, into="parity")
    assert digest(store, LAYOUT.graded_dir) == before  # byte-identical, nothing added or moved
    assert report.shards == len(before) and report.regraded == report.samples and report.kept == 0
    check_parity_regrade(store, "parity", report)
    # the same count by DuckDB, joining the two layers on identity
    old, new = open_run(store), open_run(store, layer="parity")  # noqa: F841
    [(n,)] = duckdb.sql(
        "SELECT count(*) FROM old JOIN new USING (worker_id, sample_id) WHERE old.reward <> new.reward"
    ).fetchall()
    assert n == report.changed
    # the run's own reward again changes nothing
    same = regrade(store, into="same")
    assert same.changed == 0 and same.changes == [] and same.reward == "areal_core.reward.math:gsm8k_reward"


@pytest.mark.slow
def test_refusals_write_nothing():
    run_uri, _ = finished_run()
    store = Store(run_uri)
    if not store.exists(LAYOUT.committed(LAYOUT.layer_dir("parity"))):
        regrade(store, reward=PARITY, into="parity")
    before = digest(store, LAYOUT.trajectories_dir)
    cases = [
        ({"into": "graded"}, "source layer"),
        ({"into": "ungraded"}, "layer of the run itself"),
        ({"into": "parity"}, "already exists"),
        ({"into": "../graded"}, "layer name"),
        ({"into": "parity", "source": "parity"}, "source layer"),
        ({"into": "y", "source": "missing"}, "missing or unfinished"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RegradeError, match=message):
            regrade(store, reward=PARITY, **kwargs)
    # an unfinished layer of another request is not taken over
    store.write_json(LAYOUT.regrade_record("half"), {"source": "graded", "reward": "other:fn", "state": "running"})
    with pytest.raises(RegradeError, match="another request"):
        regrade(store, reward=PARITY, into="half")
    store.delete(LAYOUT.layer_dir("half"), recursive=True)
    assert digest(store, LAYOUT.trajectories_dir) == before
    for argv, message in (
        ([run_uri, "--into", "graded"], "never writes in place"),
        ([run_uri + "-x", "--into", "a"], "not prepared"),
    ):
        with pytest.raises(SystemExit, match=message):  # the CLI: one line, no traceback
            regrade_cli(argv)
    with pytest.raises(Exception, match="cannot import"):
        regrade(store, reward="no.such.module:fn", into="z")
    assert not store.find(LAYOUT.layer_dir("z"))


@pytest.mark.slow
def test_a_retried_regrade_continues_keeps_workflow_rewards_and_skips_corrupt_shards(tmp_path):
    run_uri, _ = finished_run()
    store = copy_run(Store(run_uri), Store(str(tmp_path / "copy")))
    shards = store.find(LAYOUT.graded_dir, ".arrow")
    # a reward the workflow set itself is kept; a corrupt source shard is skipped, not moved
    first = decode_shard(store.read_bytes(shards[0]))
    first[0].reward_info = {"reward_source": "workflow"}
    first[0].reward = 0.5
    store.write_bytes(shards[0], encode_shard(first))
    store.write_bytes(LAYOUT.graded_shard("rollout-0", 99999), b"not arrow")
    # an attempt that died right after claiming the layer: the same request continues it
    request = {"source": "graded", "reward": PARITY, "state": "running"}
    store.write_json(LAYOUT.regrade_record("retry"), request)
    report = regrade(store, reward=PARITY, into="retry")
    assert report.resumed_shards == 0
    assert report.kept == 1 and report.unreadable and "99999" in report.unreadable[0]
    assert store.exists(LAYOUT.graded_shard("rollout-0", 99999))
    new = decode_shard(store.read_bytes(LAYOUT.layer_shard("retry", *LAYOUT.shard_worker_seq(shards[0]))))
    assert new[0].reward == 0.5 and new[0].reward_info == {"reward_source": "workflow"}
    # now a second attempt of a request whose first attempt wrote shards but did not commit
    store.delete(LAYOUT.committed(LAYOUT.layer_dir("retry")))
    store.write_json(LAYOUT.regrade_record("retry"), request)
    for rel in store.find(LAYOUT.layer_dir("retry"), ".arrow")[2:]:
        store.delete(rel)
    again = regrade(store, reward=PARITY, into="retry")
    assert again.resumed_shards == 2 and again.changed == report.changed and again.samples == report.samples
    assert sorted(c["identity"] for c in again.changes) == sorted(c["identity"] for c in report.changes)


@pytest.mark.slow
@pytest.mark.s3
def test_regrade_on_s3(s3_bucket):
    run_uri, _ = finished_run()
    store = copy_run(Store(run_uri), Store(f"{s3_bucket}/runs/job"))
    before = digest(store, LAYOUT.graded_dir)
    report = regrade(store.uri, reward=PARITY, into="parity")
    assert digest(store, LAYOUT.graded_dir) == before
    check_parity_regrade(store, "parity", report)
    with pytest.raises(RegradeError, match="already exists"):
        regrade(store.uri, reward=PARITY, into="parity")
    assert json.loads(store.read_text(LAYOUT.regrade_record("parity")))["shards"] == len(before)


# a re-grade that writes two shards (one per pool call), then hangs until it is killed
HANGS_AFTER_TWO = """
import sys, time, areal_core.reward.regrade as r
r.BATCH_SAMPLES = 1
real, calls = r._grade_and_write, []
def hang(*args):
    calls.append(1)
    if len(calls) > 2:
        time.sleep(600)
    real(*args)
r._grade_and_write = hang
r.main(sys.argv[1:])
"""


def kill_when(proc: subprocess.Popen, ready, timeout_s: float = 300) -> None:
    """SIGKILL the process group of `proc` (it and its pool) once `ready()` holds."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the process never got there"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.mark.slow
def test_a_regrade_killed_midway_is_continued_by_its_retry(tmp_path):
    """A re-grade SIGKILLed after two shards: the retried task (the same request) keeps those two
    as written, grades the rest and commits the layer a single run would have written."""
    run_uri, _ = finished_run()
    store = copy_run(Store(run_uri), Store(str(tmp_path / "copy")))
    sources = store.find(LAYOUT.graded_dir, ".arrow")
    layer = LAYOUT.layer_dir("killed")
    argv = [store.uri, "--into", "killed", "--reward", PARITY, "--pool-size", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HANGS_AFTER_TWO, *argv], cwd=ROOT, env=env, start_new_session=True)
    kill_when(proc, lambda: len(store.find(layer, ".arrow")) >= 2)
    written = digest(store, layer)
    assert len([p for p in written if p.endswith(".arrow")]) == 2 < len(sources)
    assert not store.exists(LAYOUT.committed(layer))
    with pytest.raises(RegradeError, match="another request"):  # not taken over by another reward
        regrade(store, reward="areal_core.reward.math:gsm8k_reward", into="killed")
    report = regrade(store, reward=PARITY, into="killed")
    assert report.resumed_shards == 2 and report.shards == len(sources)
    assert all(digest(store, layer)[p] == h for p, h in written.items() if p.endswith(".arrow"))
    check_parity_regrade(store, "killed", report)
    with pytest.raises(RegradeError, match="already exists"):
        regrade(store, reward=PARITY, into="killed")


def test_a_pool_of_no_processes_is_refused_before_claiming_a_layer():
    run_uri, _ = finished_run()
    store = Store(run_uri)
    for size in (0, -1):
        with pytest.raises(RegradeError, match="pool_size"):
            regrade(store, reward=PARITY, into="nopool", pool_size=size)
    assert not store.find(LAYOUT.layer_dir("nopool"))
