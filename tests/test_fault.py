"""Pod loss: every role is killed with SIGKILL (the whole process tree, as when a pod dies) at
random points, several times, and restarted, while a run is in progress. The run must complete
with every sample accounted for from the records alone (trained exactly once, dropped with a
record, or still waiting), no staleness violation after any resume, and the rollout workers' sequence numbers
and group indices continuing without gaps or repeats."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.run import pipeline
from areal_core.run.launcher import start_role
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.accounting import row_accounting
from areal_core.train.drops import read_drops

KILLS = {"trainer-0": 3, "rollout-0": 2, "reward-0": 2}


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (the reward pool's forked graders), children first."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out += process_tree(int(child))
    except FileNotFoundError:
        pass
    return [*out, pid]


def kill_tree(proc) -> None:
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def samples_in(store: Store, prefix: str) -> dict[str, list]:
    return {rel: decode_shard(store.read_bytes(rel)) for rel in store.find(prefix, ".arrow")}


def assert_every_sample_accounted(store: Store, cfg) -> tuple[dict[str, list], dict, set[str]]:
    """Every step trained once, no sample twice, the hard bound after every resume; and every
    sample written settled exactly once from the records alone (train/accounting.py): trained,
    dropped with a record (idle drops included), or still pending or unconsumed at the end; the
    stale drop records are as many as the trainer counted. Returns (graded shards, the row
    accounting, the identities of the recorded drops)."""
    # -- the trained set: every step once, no sample twice, the hard bound after every resume
    steps = [store.read_json(p) for p in store.find("trainer/trained", ".json")]
    assert [s["step"] for s in steps] == list(range(cfg.train.steps))
    trained = [sid for s in steps for sid, _ in s["samples"]]
    assert len(trained) == len(set(trained)), [k for k, v in Counter(trained).items() if v > 1]
    assert len(trained) == cfg.train.steps * cfg.train.batch_groups * cfg.rollout.group_size
    for s in steps:
        for _, min_version in s["samples"]:
            assert min_version >= s["trainer_version"] - cfg.train.eta, s["step"]
        assert all(min_v < s["trainer_version"] - cfg.train.eta for _, min_v in s["dropped"])
    drops = read_drops(store)
    assert all(d["version"] < d["trainer_version"] - cfg.train.eta for d in drops if d["reason"] == "stale")

    # -- no sample lost, none settled twice: from the records alone, no counter subtracted
    assert checkpoint.committed_steps(store)[-1] == cfg.train.steps
    rows = row_accounting(store)
    assert (rows["lost"], rows["trained_twice"], rows["dropped_twice"], rows["dropped_and_trained"]) == (0, 0, 0, 0), (
        rows
    )
    counters = store.read_json(LAYOUT.done)["counters"]
    assert rows["dropped_by_reason"].get("stale", 0) == counters["dropped_samples"], (rows, counters)
    return samples_in(store, "trajectories/graded"), rows, {f"{d['worker']}/{d['sample_id']}" for d in drops}


@pytest.mark.slow
def test_roles_killed_at_random_points_and_restarted(tiny_overrides, tmp_path):
    rng = random.Random(int(os.environ.get("AREAL_FAULT_SEED", "7")))
    overrides = [
        *tiny_overrides,
        "train.steps=30",
        "train.checkpoint_every=1",
        "train.slow_step_s=0.6",  # long enough a run for every kill to land mid-run
        "train.eta=2",
    ]
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)
    store = Store(run_uri)
    cfg = load_run_config(store)
    log = (tmp_path / "roles.log").open("w")
    roles = {"trainer-0": ("trainer", 0), "rollout-0": ("rollout", 0), "reward-0": ("reward", 0)}
    procs = {name: start_role(role, run_uri, index, log_sink=log) for name, (role, index) in roles.items()}
    left = dict(KILLS)
    killed: list[tuple[str, float, int]] = []  # (role, seconds since start, its progress when killed)

    def progress(name: str) -> int:
        """Work done: trainer steps, rollout shards, graded shards. A role is killed only after it
        made progress since its (re)start, at a random moment of that work."""
        key = {"trainer-0": "step", "rollout-0": "seq"}.get(name)
        if key is None:
            return len(store.find("trajectories/graded", ".arrow"))
        try:
            return int(store.read_json(f"status/{name}.json").get(key, 0))
        except (FileNotFoundError, ValueError):
            return 0

    mark = {name: progress(name) for name in roles}
    t0 = time.time()
    try:
        while any(left.values()) and not store.done() and time.time() - t0 < 400:
            time.sleep(rng.uniform(0.5, 3.0))
            ready = [n for n, k in left.items() if k and progress(n) > mark[n] and procs[n].proc.poll() is None]
            if not ready or store.done():
                continue
            name = rng.choice(ready)
            done_work = progress(name)
            kill_tree(procs[name].proc)
            killed.append((name, round(time.time() - t0, 1), done_work))
            left[name] -= 1
            role, index = roles[name]
            procs[name] = start_role(role, run_uri, index, log_sink=log)
            mark[name] = progress(name)
        deadline = time.time() + 300
        while any(p.proc.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                kill_tree(p.proc)
        log.close()
    text = (tmp_path / "roles.log").read_text()
    assert not any(left.values()), f"the run ended before every kill: {killed}"
    assert all(p.proc.returncode == 0 for p in procs.values()), text[-4000:]
    assert store.done(), text[-4000:]
    assert "resumed at step" in text  # the trainer restored a checkpoint at least once

    graded, rows, recorded_drops = assert_every_sample_accounted(store, cfg)

    # -- rollout: sequence numbers and group indices continue across restarts (no gap, no repeat)
    ungraded = samples_in(store, "trajectories/ungraded/rollout-0")
    seqs = sorted(int(Path(rel).stem) for rel in ungraded)
    assert seqs == list(range(len(seqs)))
    groups = [s.group_id for rel in sorted(ungraded) for s in ungraded[rel]]
    indices = sorted({int(g.rsplit("-g", 1)[1]) for g in groups})
    assert indices == list(range(len(indices)))
    assert Counter(groups) == {g: cfg.rollout.group_size for g in set(groups)}
    # -- reward: a graded shard is its ungraded twin, whole
    for rel, shard in graded.items():
        twin = rel.replace("/graded/", "/ungraded/", 1)
        assert [s.sample_id for s in shard] == [s.sample_id for s in ungraded[twin]]
        assert all(s.reward is not None for s in shard)
    print(f"kills: {killed}; drops by reason {rows['dropped_by_reason']}, rows {rows['written']}")
