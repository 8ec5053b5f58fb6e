"""The trainer role under torchrun with two gloo ranks (FSDP2), on real runs with rollout and
reward processes: the same curve as one process on the same shards, resume after SIGKILL, and
no weights version number reused after a restart from an older checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.run import pipeline
from areal_core.run.launcher import start_role
from areal_core.run.roles import run_role
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.accounting import row_accounting
from tests.conftest import BIN, ROOT, TINY

# graded groups with rewards that vary inside every group (the tiny model rarely solves a problem,
# and all-zero rewards would give zero advantages and a flat loss that matches trivially)
REWARD_FN = "tests.test_fsdp_trainer:parity_reward"


def parity_reward(completion: str) -> float:
    """1 for a completion of odd length: a deterministic, non-constant reward."""
    return float(len(completion) % 2)


def prepare(tmp_path: Path, name: str, extra: list[str]) -> Store:
    overrides = [*TINY, f"store={tmp_path / name}", "sft.enabled=false", f"reward.function={REWARD_FN}", *extra]
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)  # sft disabled: only the initial model into the run root
    return Store(run_uri)


def torchrun_trainer(store: Store, log_path: Path, nproc: int = 2) -> subprocess.Popen:
    """`python -m areal_core.run.roles trainer` on `nproc` gloo ranks, as the Elastic task runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "areal_core.run.roles"]
    cmd += ["trainer", "--run-uri", store.uri, "--index", "0"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_path.open("a"), stderr=subprocess.STDOUT)


def process_tree(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out += process_tree(int(child))
    except FileNotFoundError:
        pass
    return [*out, pid]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and all its descendants (a pod lost: torchrun and both ranks at once)."""
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_all(procs: dict[str, subprocess.Popen], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    try:
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            failed = {k: p.returncode for k, p in procs.items() if p.poll() not in (None, 0)}
            assert not failed, failed
            time.sleep(0.3)
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_tree(p)
    assert all(p.returncode == 0 for p in procs.values()), {k: p.returncode for k, p in procs.items()}


def graded_groups(store: Store) -> int:
    return len({s.group_id for rel in store.find("trajectories/graded", ".arrow") for s in read(store, rel)})


def read(store: Store, rel: str) -> list:
    try:
        return decode_shard(store.read_bytes(rel))
    except Exception:  # being written
        return []


def publish_initial_weights(store: Store) -> None:
    """weights/v0 as the trainer publishes it at start, so rollout can generate before it runs."""
    from areal_core.layout import LAYOUT
    from areal_core.models import load_pretrained
    from areal_core.weights.publisher import hf_side_files, publish, state_dict_bytes

    model, tok = load_pretrained(store.url(LAYOUT.init_model), "cpu")
    publish(store, 0, state_dict_bytes(model), hf_side_files(model, tok))


def trained_steps(store: Store) -> list[dict]:
    return [store.read_json(p) for p in store.find("trainer/trained", ".json")]


def metrics(store: Store) -> list[dict]:
    return [json.loads(line) for line in store.read_text("trainer/metrics.jsonl").splitlines() if line]


@pytest.mark.slow
def test_two_rank_trainer_matches_one_process_on_the_same_shards(tmp_path):
    """Rollout and reward processes pre-generate exactly `steps` batches of groups under v0
    (η = steps − 1 admits (η + 1)·B groups before v1). The run root is copied; on the original,
    the trainer runs as 2 gloo ranks under torchrun while rollout and reward keep running (their
    later groups carry v ≥ 1, so they sort after the v0 groups and never enter these steps); on
    the copy, one trainer runs alone (in the test process). Every step trains the same samples,
    so the loss curve, gradient norms, final weights and the checkpointed optimizer state must
    agree."""
    steps, batch = 4, 2
    store = prepare(tmp_path, "fsdp", [f"train.steps={steps}", f"train.eta={steps - 1}", "train.checkpoint_every=2"])
    cfg = load_run_config(store)
    log = (tmp_path / "roles.log").open("w")
    publish_initial_weights(store)
    procs = {
        "rollout": start_role("rollout", store.uri, 0, log_sink=log).proc,
        "reward": start_role("reward", store.uri, 0, log_sink=log).proc,
    }
    try:
        deadline = time.time() + 400  # generous: CI shares its 2 cores with other jobs
        while graded_groups(store) < steps * batch and time.time() < deadline:
            assert all(p.poll() is None for p in procs.values())
            time.sleep(0.3)
        time.sleep(1.0)
        # admission holds the rollout worker at exactly (η + 1)·B groups under v0 until v1 appears
        assert graded_groups(store) == steps * batch
        ref = Store(str(tmp_path / "ref"))  # the same shards for the single-process trainer
        shutil.copytree(store.local_path(), ref.local_path(), ignore=shutil.ignore_patterns("status", ".*"))
        procs["trainer-fsdp"] = torchrun_trainer(store, tmp_path / "fsdp.log")
        run_role("trainer", ref.uri)  # meanwhile, the reference: one trainer in this process
        wait_all(procs, 400)  # rollout and reward stop when the 2-rank trainer writes DONE
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_tree(p)
        log.close()
    fsdp_log = (tmp_path / "fsdp.log").read_text()
    assert "rank 1/2 (local 1) joined with gloo on cpu" in fsdp_log, fsdp_log[-3000:]
    assert store.read_json("DONE")["world_size"] == 2 and ref.read_json("DONE")["world_size"] == 1

    # the same samples, step by step, all generated under v0
    got, want = trained_steps(store), trained_steps(ref)
    assert [t["step"] for t in got] == [t["step"] for t in want] == list(range(steps))
    for g, w in zip(got, want):
        assert g["samples"] == w["samples"] and {v for _, v in g["samples"]} == {0}
    # the curve
    m_got, m_want = metrics(store), metrics(ref)
    assert len(m_got) == len(m_want) == steps
    for g, w in zip(m_got, m_want):
        for key in ("loss", "grad_norm", "clip_frac", "importance_weight_mean", "kl_behav_prox"):
            assert g[key] == pytest.approx(w[key], rel=0, abs=1.5e-4), (g["step"], key)  # 4 decimals logged
        assert g["reward_mean"] == w["reward_mean"] and g["response_tokens"] == w["response_tokens"]
    assert all(w["grad_norm"] > 1e-3 for w in m_want)  # a real signal: non-zero advantages
    assert len({w["loss"] for w in m_want}) > 1
    # final weights: equal, and moved away from the initial model
    final_got = load_file(store.local_path("final_model/model.safetensors"))
    final_want = load_file(ref.local_path("final_model/model.safetensors"))
    init = load_file(ref.local_path("init_model/model.safetensors"))
    assert set(final_got) == set(final_want)
    for name, tensor in final_want.items():
        torch.testing.assert_close(final_got[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert max(float((final_want[k] - init[k]).abs().max()) for k in init) > 1e-3
    # the 2-rank checkpoint has the single-process format (so it restores under any world size)
    base = LAYOUT.checkpoint_dir(steps)
    opt_got = torch.load(store.local_path(f"{base}/optimizer.pt"), weights_only=False)["optimizer"]
    opt_want = torch.load(ref.local_path(f"{base}/optimizer.pt"), weights_only=False)["optimizer"]
    assert set(opt_got["state"]) == set(opt_want["state"])
    assert [g["params"] for g in opt_got["param_groups"]] == [g["params"] for g in opt_want["param_groups"]]
    for idx, state in opt_want["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_got["state"][idx][key], state[key], rtol=2e-3, atol=1e-6)
        assert float(opt_got["state"][idx]["step"]) == float(state["step"]) == steps
    # the 2-rank trainer also ingested the pool's later shards (v ≥ 1), left pending
    assert set(ref.read_json(f"{base}/state.json")["consumed"]) <= set(
        store.read_json(f"{base}/state.json")["consumed"]
    )
    assert cfg.train.eta == steps - 1


@pytest.mark.slow
def test_two_rank_trainer_killed_mid_run_resumes_without_training_a_sample_twice(tmp_path):
    """SIGKILL torchrun and both ranks right after an uncheckpointed publish (checkpoint_every = 2,
    killed at an odd step), restart: the trainer resumes from the older checkpoint, publishes it
    under a new number above every published one (no v{N} rewritten), drops samples of the
    abandoned versions, and reaches DONE with every sample trained at most once."""
    steps = 6
    store = prepare(
        tmp_path,
        "fault",
        [f"train.steps={steps}", "train.checkpoint_every=2", "train.eta=2", "train.slow_step_s=0.5"],
    )
    cfg = load_run_config(store)
    log = (tmp_path / "roles.log").open("w")
    tlog = tmp_path / "trainer.log"
    procs = {
        "rollout": start_role("rollout", store.uri, 0, log_sink=log).proc,
        "reward": start_role("reward", store.uri, 0, log_sink=log).proc,
        "trainer": torchrun_trainer(store, tlog),
    }
    manifests: dict[int, str] = {}
    try:
        killed_at = None
        deadline = time.time() + 400
        while killed_at is None and time.time() < deadline:
            assert procs["trainer"].poll() is None, tlog.read_text()[-3000:]
            try:
                step = int(store.read_json("status/trainer-0.json")["step"])
            except (FileNotFoundError, ValueError, KeyError):
                step = 0
            if step >= 3 and step % 2 == 1:  # v{step} published, newest checkpoint step − 1
                kill_tree(procs["trainer"])
                killed_at = step
            time.sleep(0.05)
        assert killed_at is not None and not store.done(), "the trainer never reached an odd step ≥ 3"
        newest = store.latest_version()
        ckpt = checkpoint.committed_steps(store)[-1]
        assert newest > ckpt  # the premise: published versions the checkpoint cannot reproduce
        ck_sha = hashlib.sha256(store.read_bytes(LAYOUT.checkpoint_file(ckpt, "model.safetensors"))).hexdigest()
        for name in store.listdir("weights"):
            if name.startswith("v") and store.exists(f"weights/{name}/MANIFEST.json"):
                manifests[int(name[1:])] = store.read_json(f"weights/{name}/MANIFEST.json")["files"]
        procs["trainer"] = torchrun_trainer(store, tlog)
        wait_all(procs, 400)
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_tree(p)
        log.close()
    text = tlog.read_text()
    assert store.done() and store.read_json("DONE")["world_size"] == 2
    assert f"resumed at step {ckpt} (version {ckpt}" in text, text[-3000:]
    done = store.read_json("DONE")
    # numbering continued after the newest published version
    assert done["version"] == steps + (newest + 1 - ckpt)
    for version, files in manifests.items():  # nothing published before the kill was rewritten
        if store.exists(f"weights/v{version:06d}/MANIFEST.json"):
            assert store.read_json(f"weights/v{version:06d}/MANIFEST.json")["files"] == files, version
    restarted = store.read_json(f"weights/v{newest + 1:06d}/MANIFEST.json")["files"]
    assert restarted["model.safetensors"] == ck_sha  # the restored weights, under a new number

    # the trained set: every step once, no sample twice, no abandoned-version or too-stale token
    records = trained_steps(store)
    assert [r["step"] for r in records] == list(range(steps))
    trained = [sid for r in records for sid, _ in r["samples"]]
    assert len(trained) == len(set(trained)), [k for k, v in Counter(trained).items() if v > 1]
    assert len(trained) == steps * cfg.train.batch_groups * cfg.rollout.group_size
    abandoned = [(ckpt + 1, newest)]
    graded = {s.sample_id: s for rel in store.find("trajectories/graded", ".arrow") for s in read(store, rel)}
    for r in records:
        for sid, min_version in r["samples"]:
            assert min_version >= r["trainer_version"] - cfg.train.eta
            produced = {v for v, m in zip(graded[sid].versions, graded[sid].loss_mask) if m}
            assert not any(lo <= v <= hi for v in produced for lo, hi in abandoned), (r["step"], sid)
    redone = [r for r in records if r["step"] >= ckpt]
    assert all(r["abandoned_versions"] == [list(a) for a in abandoned] for r in redone)
    # every written sample: trained, dropped with a record (stale or abandoned), pending or never
    # consumed, once, from the records alone (train/accounting.py)
    rows = row_accounting(store)
    settled_twice = (rows["trained_twice"], rows["dropped_twice"], rows["dropped_and_trained"])
    assert rows["lost"] == 0 and settled_twice == (0, 0, 0), rows
    counters = store.read_json(LAYOUT.done)["counters"]
    by_reason = rows["dropped_by_reason"]
    assert by_reason.get("stale", 0) == counters["dropped_samples"], (rows, counters)
    assert by_reason.get("abandoned_version", 0) == counters.get("abandoned_samples", 0), (rows, counters)
    print(f"killed at step {killed_at}: checkpoint {ckpt}, newest v{newest}, counters {counters}")
