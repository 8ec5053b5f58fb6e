"""Hostile objects in the store (issue 24): every shard is validated before it is trusted, every
checkpoint and init_model is checked against its manifest, and the run goes on, counting what it
refused. Each crafted object is written where a real role would find it."""

from __future__ import annotations

import io
import os
import platform
import random
import resource
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from areal_core.context import load_run_config
from areal_core.events import EventLog, read_events
from areal_core.ipc_reader import is_compressed
from areal_core.layout import LAYOUT
from areal_core.manifest import MANIFEST_NAME, ManifestError, make_manifest
from areal_core.protocol import SCHEMA, Sample, ShardError, ShardLimits, decode_shard, encode_shard, to_table
from areal_core.report import series
from areal_core.report.doctor import diagnose
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.run_trainer import build_run_trainer
from tests.conftest import TINY
from tests.test_lineage import groups

ROOT = Path(__file__).resolve().parents[1]


def sample(i: int = 0, ids=None, versions=None, mask=None) -> Sample:
    ids = ids or [5, 6, 7, 8]
    n = len(ids)
    mask = mask or [0, 0] + [1] * (n - 2)
    versions = versions or [-1, -1] + [0] * (n - 2)
    return Sample(f"s{i}", "g", "p", "w", ids, 2, mask, [0.0] * n, versions, reward=1.0)


def ipc(table: pa.Table, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def bad_offsets_shard() -> bytes:
    """A valid shard whose input_ids offsets are rewritten to [0, 10^8, 5]: pyarrow's file reader
    accepts it and to_pylist then reads out of bounds (SIGSEGV)."""
    good = encode_shard([sample(0), sample(1)])
    at = good.find(struct.pack("<3i", 0, 4, 8))
    assert at > 0
    return good[:at] + struct.pack("<3i", 0, 10**8, 5) + good[at + 12 :]


def mismatched_lengths_shard() -> bytes:
    table = to_table([sample(0)])
    cols = {n: table[n] for n in SCHEMA.names}
    cols["versions"] = pa.array([[-1, -1, 0]], pa.list_(pa.int32()))  # 3 versions for 4 tokens
    return ipc(pa.table(cols, schema=SCHEMA))


# -- shards ------------------------------------------------------------------------------------
def test_the_crafted_offsets_crash_pyarrow_but_not_decode_shard():
    data = bad_offsets_shard()
    probe = (
        "import sys, pyarrow as pa; pa.ipc.open_file(pa.BufferReader(sys.stdin.buffer.read())).read_all().to_pylist()"
    )
    crashed = subprocess.run([sys.executable, "-c", probe], input=data, capture_output=True, timeout=60)
    assert crashed.returncode != 0  # what the trainer did before: a segfault, every resume
    with pytest.raises(ShardError, match="[Oo]ffset"):
        decode_shard(data)


@pytest.mark.parametrize(
    ("make", "limits", "reason"),
    [
        (lambda: encode_shard([sample(0, ids=[5, 6, 7, 99])]), ShardLimits(vocab_size=50), "token ids"),
        (lambda: encode_shard([sample(0, ids=[-3, 6, 7, 8])]), ShardLimits(), "token ids"),
        (lambda: encode_shard([sample(0, versions=[-1, -1, 0, 9])]), ShardLimits(max_version=4), "versions"),
        (lambda: encode_shard([sample(0, versions=[-1, -1, -2, 0])]), ShardLimits(), "versions"),
        (
            lambda: encode_shard([sample(0, ids=list(range(5, 69)))]),
            ShardLimits(max_tokens=16),
            "tokens",
        ),
        (mismatched_lengths_shard, ShardLimits(), "length"),
        (lambda: encode_shard([sample(k) for k in range(9)]), ShardLimits(max_rows=8), "rows"),
        (lambda: encode_shard([sample(0)]), ShardLimits(max_bytes=100), "bytes"),
        (lambda: b"ARROW1\x00\x00" + os.urandom(200) + b"ARROW1", ShardLimits(), "Arrow IPC"),
        (lambda: encode_shard([sample(0)])[:-40], ShardLimits(), "Arrow IPC"),
        (lambda: b"", ShardLimits(), "Arrow IPC"),
    ],
)
def test_a_shard_that_breaks_a_limit_is_refused_with_the_reason(make, limits, reason):
    with pytest.raises(ShardError, match=reason):
        decode_shard(make(), limits)


def test_a_compression_bomb_is_refused_before_it_inflates():
    rows, width = 100, 1_000_000
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, pa.array(np.zeros(rows * width, np.int32)))
    bomb = ipc(pa.table({"input_ids": column}), compression="zstd")
    assert len(bomb) < 100_000  # 400 MB of int32 zeros
    message = pa.ipc.read_message(pa.BufferReader(bomb[8:]))  # the schema
    assert message.type == "schema"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ShardError, match="compressed"):
        decode_shard(bomb)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 400_000  # KiB: nothing inflated


def test_the_compression_flag_is_read_from_the_message_metadata():
    plain, packed = (ipc(to_table([sample()]), compression=c) for c in (None, "lz4"))
    flags = []
    for data in (plain, packed):
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(data[8:]))
        reader.read_next_message()  # the schema
        flags.append(is_compressed(reader.read_next_message().metadata.to_pybytes()))
    assert flags == [False, True]


# -- the trainer goes on ------------------------------------------------------------------------
def prepared(tmp_path, *extra: str) -> tuple[str, Store]:
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", "sft.enabled=false", *extra])
    pipeline.sft(run_uri)
    return run_uri, Store(run_uri)


def test_the_trainer_quarantines_every_crafted_shard_and_reaches_done(tmp_path):
    run_uri, store = prepared(tmp_path, "train.steps=2", "train.eta=4")
    cfg = load_run_config(store)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    rng = random.Random(0)
    crafted = {
        "offsets": bad_offsets_shard(),
        "oov": encode_shard([sample(0, ids=[5, 6, 7, vocab]), sample(1)]),
        "negative": encode_shard([sample(0, ids=[5, -1, 7, 8]), sample(1)]),
        "future": encode_shard([sample(0, versions=[-1, -1, 0, 3]), sample(1)]),
        "long": encode_shard([sample(0, ids=[5] * 40000)]),
        "lengths": mismatched_lengths_shard(),
        "bomb": ipc(pa.table({"x": pa.array([[0] * 10**6] * 50, pa.list_(pa.int32()))}), compression="zstd"),
    }
    for k, name in enumerate(crafted):
        store.write_bytes(LAYOUT.graded_shard(f"evil-{name}", k), crafted[name])
    store.write_bytes(f"{LAYOUT.graded_dir}/w/copy-of-1.arrow", encode_shard(groups(rng, "a", 4, 0, vocab)))
    trainer = build_run_trainer(run_uri, cfg)
    trainer.fit()
    done = store.read_json(LAYOUT.done)
    assert done["step"] == 2 and done["counters"]["quarantined_shards"] == len(crafted)
    assert done["counters"]["trained_samples"] == 2 * 2 * 4  # the odd name is just a name
    reasons = [store.read_json(r)["reason"] for r in store.find(LAYOUT.quarantine_dir, ".json")]
    assert len(reasons) == len(crafted) and all(reasons)


def test_a_trainer_resumes_past_a_bad_shard(tmp_path):
    run_uri, store = prepared(tmp_path, "train.steps=2")
    cfg = load_run_config(store)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard(groups(random.Random(1), "a", 2, 0, vocab)))
    first = build_run_trainer(run_uri, cfg)
    first.start()
    batch = first.source.next_batch(first.state)
    first.step(batch.samples, batch.dropped)
    first.save_checkpoint()
    del first  # killed; meanwhile a shard that used to segfault every resume arrives
    store.write_bytes(LAYOUT.graded_shard("w", 1), bad_offsets_shard())
    store.write_bytes(LAYOUT.graded_shard("w", 2), encode_shard(groups(random.Random(2), "b", 2, 1, vocab)))
    again = build_run_trainer(run_uri, cfg)
    again.fit()
    assert store.read_json(LAYOUT.done)["counters"]["quarantined_shards"] == 1
    assert store.exists(LAYOUT.quarantined(LAYOUT.graded_shard("w", 1)))


# -- checkpoints and init_model -----------------------------------------------------------------
def two_checkpoints(tmp_path) -> tuple[str, Store, object]:
    run_uri, store = prepared(tmp_path, "train.steps=4", "train.checkpoint_every=1", "train.eta=8")
    cfg = load_run_config(store)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard(groups(random.Random(3), "a", 4, 0, vocab)))
    trainer = build_run_trainer(run_uri, cfg)
    trainer.start()
    for _ in range(2):
        batch = trainer.source.next_batch(trainer.state)
        trainer.step(batch.samples, batch.dropped)
    assert checkpoint.committed_steps(store) == [1, 2]
    assert store.exists(LAYOUT.checkpoint_file(2, MANIFEST_NAME))
    return run_uri, store, cfg


def flip(store: Store, rel: str, at: int = -100) -> None:
    data = bytearray(store.read_bytes(rel))
    data[at] ^= 0x01
    store.write_bytes(rel, bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: flip(s, LAYOUT.checkpoint_file(2, checkpoint.MODEL_FILE)),
        lambda s: flip(s, LAYOUT.checkpoint_file(2, checkpoint.OPTIMIZER_FILE)),
        lambda s: flip(s, LAYOUT.checkpoint_file(2, checkpoint.STATE_FILE), at=5),
        lambda s: s.write_bytes(
            LAYOUT.checkpoint_file(2, checkpoint.MODEL_FILE),
            s.read_bytes(LAYOUT.checkpoint_file(2, checkpoint.MODEL_FILE))[:1000],
        ),
        lambda s: s.delete(LAYOUT.checkpoint_file(2, checkpoint.SEEN_FILE)),
        lambda s: s.write_text(LAYOUT.checkpoint_file(2, MANIFEST_NAME), "{not json"),
    ],
    ids=["model-bit", "optimizer-bit", "state-bit", "truncated", "missing", "manifest"],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_one(tmp_path, damage, caplog):
    run_uri, store, cfg = two_checkpoints(tmp_path)
    damage(store)
    resumed = build_run_trainer(run_uri, cfg)
    assert resumed.state.step == 1  # step 2 failed verification: step 1's weights, optimizer, state
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step-000002" in skipped[0]


def test_a_skipped_checkpoint_is_an_event_and_a_finding_of_the_run_report(tmp_path):
    run_uri, store, cfg = two_checkpoints(tmp_path)
    assert not [r for r in read_events(store) if r["kind"] == "checkpoint_skipped"]
    flip(store, LAYOUT.checkpoint_file(2, checkpoint.MODEL_FILE))
    with EventLog(store, "trainer", "0") as events:
        assert build_run_trainer(run_uri, cfg, events=events).state.step == 1
    [event] = [r for r in read_events(store) if r["kind"] == "checkpoint_skipped"]
    assert event["step"] == 2 and checkpoint.MODEL_FILE in event["reason"]
    [finding] = [f for f in diagnose(read_events(store)) if "skipped" in f.title]
    assert finding.kind == "health" and "step 2" in finding.title and checkpoint.MODEL_FILE in finding.evidence
    assert list(series.reasons(read_events(store))["checkpoint_skipped"].values()) == [1]


def test_no_verifying_checkpoint_refuses_to_start_over(tmp_path):
    run_uri, store, cfg = two_checkpoints(tmp_path)
    for step in (1, 2):
        flip(store, LAYOUT.checkpoint_file(step, checkpoint.MODEL_FILE))
    with pytest.raises(checkpoint.CheckpointError, match="none of the committed checkpoints"):
        build_run_trainer(run_uri, cfg)


class Evil:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["EVIL_MARK"]),))


def test_a_pickle_in_the_store_never_runs_code_even_with_a_forged_manifest(tmp_path, monkeypatch):
    run_uri, store, cfg = two_checkpoints(tmp_path)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    buf = io.BytesIO()
    torch.save({"optimizer": Evil(), "rng": torch.get_rng_state()}, buf)
    store.write_bytes(LAYOUT.checkpoint_file(2, checkpoint.OPTIMIZER_FILE), buf.getvalue())
    files = {
        r.rsplit("/", 1)[-1]: store.read_bytes(r)
        for r in store.find(LAYOUT.checkpoint_dir(2))
        if not r.endswith((MANIFEST_NAME, LAYOUT.committed_name))
    }
    store.write_json(LAYOUT.checkpoint_file(2, MANIFEST_NAME), make_manifest(files, step=2))  # forged
    resumed = build_run_trainer(run_uri, cfg)
    assert resumed.state.step == 1 and not mark.exists()


def test_a_flipped_byte_in_init_model_stops_every_role_that_loads_it(tmp_path):
    run_uri, store = prepared(tmp_path)
    assert store.exists(f"{LAYOUT.init_model}/{MANIFEST_NAME}")
    flip(store, f"{LAYOUT.init_model}/model.safetensors")
    with pytest.raises(ManifestError, match="model.safetensors fails its sha256"):
        build_run_trainer(run_uri, load_run_config(store))


# -- shards under names no writer gives ---------------------------------------------------------
def test_readers_that_take_a_position_from_a_shard_name_tolerate_odd_names(tmp_path):
    from areal_core.online.retrain import advance, new_shards
    from areal_core.proxy.shards import ShardWriter
    from areal_core.rollout.admission import recover_progress

    store = Store(str(tmp_path / "root"))
    good = encode_shard([sample(0)])  # group "g": not of rollout-0's form
    mine = encode_shard([replace(sample(1), group_id="rollout-0-g0000005")])
    store.write_bytes(LAYOUT.ungraded_shard("rollout-0", 1), mine)
    for rel in (LAYOUT.ungraded_shard("rollout-0", 3), f"{LAYOUT.shard_dir('ungraded', 'rollout-0')}/copy-of-1.arrow"):
        store.write_bytes(rel, good)
    progress = recover_progress(store, "rollout-0")
    assert progress.next_seq == 4 and progress.groups == {5}  # the odd name holds no position, foreign rows no group
    store.write_bytes(LAYOUT.graded_shard("proxy-0", 2), good)
    odd = f"{LAYOUT.shard_dir('graded', 'proxy-0')}/1 (2).arrow"
    store.write_bytes(odd, good)
    shards = new_shards(store, {"proxy-0": 2})
    assert shards == [odd] and advance({"proxy-0": 2}, shards) == {"proxy-0": 2}
    assert ShardWriter(store, "proxy-0").seq == 3


def test_the_report_reads_a_hostile_config_yaml_within_bounds(tmp_path):
    import time

    from areal_core.config import ConfigError
    from areal_core.report.data import load_run
    from areal_core.run.pipeline import parse_overrides

    store = Store(str(tmp_path / "run"))
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    )
    store.write_text(LAYOUT.config, laughs)  # 9^9 leaves once expanded
    t0 = time.monotonic()
    assert load_run(store).config == {}
    assert time.monotonic() - t0 < 60  # expanded, 9^9 leaves would take far longer (and the memory)
    with pytest.raises(ConfigError) as err:
        parse_overrides('a="' + "x" * 10_000)
    assert len(str(err.value)) < 400  # an excerpt of the value, not the value


# -- a reward function's own children ----------------------------------------------------------
def spawning_reward(**_: object) -> float:
    """A reward function that starts a child of its own and hangs."""
    import time as _time

    setsid = os.environ.get("CHILD_SETSID") == "1"  # a child that leaves the grader's process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=setsid)
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(child.pid))
    _time.sleep(600)
    return 1.0


@pytest.mark.parametrize("setsid", [False, True], ids=["in_its_group", "after_setsid"])
def test_a_timed_out_reward_function_takes_its_children_with_it(tmp_path, monkeypatch, setsid):
    import time

    from areal_core.reward.pool import RewardPool

    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("CHILD_PID_FILE", str(pid_file))
    monkeypatch.setenv("CHILD_SETSID", "1" if setsid else "0")
    # the function hangs for 600 s: the limit only has to leave room to start the child under load
    pool = RewardPool("tests.test_hostile_store:spawning_reward", size=1, timeout_s=8.0, retries=0)
    try:
        [result] = pool.grade([{"completion": "x"}])
        assert "timeout" in result.info["error"]
        child = int(pid_file.read_text())
        deadline = time.monotonic() + 120  # killed with the grader: only a survivor reaches this
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
            state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}").exists() else "X"
            if state == "Z":  # killed, waiting for its (dead) parent to be reaped
                break
            time.sleep(0.1)
        alive = Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        assert not alive, "the reward function's child outlived the pool's timeout"
    finally:
        pool.close()


# -- the code sandbox's kernel surface ----------------------------------------------------------
SYSCALL_PROBE = r"""
import ctypes, os, socket
from areal_probe import CALLS
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, nr, args in CALLS:
    ctypes.set_errno(0)
    out[name] = (libc.syscall(nr, *args), ctypes.get_errno())
for name, family in (("netlink", 16), ("unix", socket.AF_UNIX)):
    try:
        socket.socket(family, socket.SOCK_RAW if family == 16 else socket.SOCK_STREAM, 0).close()
        out[name] = "opened"
    except OSError as exc:
        out[name] = exc.errno
print(out)
"""


@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (.ci/run installs it)")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe's syscall numbers are x86_64's")
def test_the_sandbox_refuses_io_uring_keyctl_bpf_perf_userfaultfd_and_netlink():
    import ast as _ast
    import errno

    from areal_core.reward.sandbox import Sandbox

    calls = [("io_uring_setup", 425, (8, 0)), ("io_uring_enter", 426, (0, 0, 0, 0, 0)), ("keyctl", 250, (0, 0)),
             ("add_key", 248, (0, 0, 0, 0, 0)), ("request_key", 249, (0, 0, 0, 0)), ("bpf", 321, (0, 0, 0)),
             ("perf_event_open", 298, (0, 0, -1, -1, 0)), ("userfaultfd", 323, (0,)),
             ("x32 write", 0x40000001, (1, 0, 0))]  # fmt: skip
    program = SYSCALL_PROBE.replace("from areal_probe import CALLS", f"CALLS = {calls!r}")
    result = Sandbox().run(program)
    assert result.ok, (result.stderr, result.reason)
    out = _ast.literal_eval(result.stdout.strip())
    assert {name: out[name] for name, _, _ in calls} == {name: (-1, errno.EPERM) for name, _, _ in calls}
    assert out["netlink"] == errno.EPERM and out["unix"] == "opened"  # a filter, not a blanket ban


INODE_FLOOD = """
import os
made = {}
for where in ("/tmp", "/dev/shm"):
    n = 0
    try:
        while n < 200_000:
            if n % 2:
                os.mkdir(f"{where}/d{n}")
            else:
                open(f"{where}/f{n}", "w").close()
            n += 1
    except OSError as exc:
        made[where] = (n, exc.errno)
    else:
        made[where] = (n, 0)
try:
    with open("/tmp/big", "wb") as f:
        f.write(b"x" * (8 << 20))
    big = 0
except OSError as exc:
    big = exc.errno
print(repr((made, big, os.getuid())))
"""


@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (.ci/run installs it)")
@pytest.mark.parametrize("inodes", [64, 1000])
def test_an_inode_flood_stops_at_the_tmpfs_cap_in_the_sandbox(inodes):
    import ast as _ast
    import errno

    from areal_core.reward.sandbox import Limits, Sandbox

    sandbox = Sandbox()
    assert sandbox.capped_tmpfs, "unshare/mount cannot cap the sandbox's tmpfs here"
    limits = Limits(wall_s=20, cpu_s=10, tmp_mb=4, tmp_inodes=inodes, fsize_mb=16)
    result = sandbox.run(INODE_FLOOD, limits=limits)
    assert result.ok, (result.stderr, result.reason)
    made, big, uid = _ast.literal_eval(result.stdout.strip())
    # /tmp and /dev/shm share one tmpfs: its root and the two folders take three inodes
    assert made["/tmp"] == (inodes - 3, errno.ENOSPC) and made["/dev/shm"] == (0, errno.ENOSPC)
    assert big == errno.ENOSPC and uid != 0  # and its bytes are capped; the program is never uid 0
    again = sandbox.run("import os; open('/tmp/x', 'w').close(); print(len(os.listdir('/tmp')))", limits=limits)
    assert again.stdout.strip() == "1"  # each run has a fresh tmpfs: the flood left nothing behind


@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (.ci/run installs it)")
def test_without_unshare_the_sandbox_falls_back_to_a_byte_capped_tmpfs(monkeypatch, caplog):
    from areal_core.reward import sandbox as sb

    real_which = shutil.which
    monkeypatch.setattr(sb.shutil, "which", lambda name: None if name == "mount" else real_which(name))
    fallback = sb.Sandbox()
    assert not fallback.capped_tmpfs
    cmd = fallback.command("/x/task", ["true"], fallback.limits)
    assert cmd[0] == fallback.bwrap and "--tmpfs" in cmd and "nr_inodes" not in " ".join(cmd)
    result = fallback.run("open('/tmp/a', 'w').write('1'); print(open('/tmp/a').read())")
    assert result.ok and result.stdout.strip() == "1"
    monkeypatch.setattr(sb, "_CAPPED", {})
    monkeypatch.setattr(sb.shutil, "which", real_which)
    monkeypatch.setattr(sb.Sandbox, "scratch_mount", lambda self, task, limits: ["/bin/false", "--"])
    with caplog.at_level("WARNING"):
        assert not sb.Sandbox().capped_tmpfs  # the capped mount fails its probe: bytes only, said once
    assert any("capped in bytes only" in r.getMessage() for r in caplog.records)


def test_the_reward_worker_quarantines_out_of_vocabulary_token_ids(tmp_path):
    """A shard whose response holds a token id the policy's vocabulary lacks is quarantined by the
    reward worker with the reason, not decoded into a completion and graded (issue 46)."""
    from areal_core.prompts import load_prompts
    from areal_core.reward.worker import run_reward_worker

    run_uri, store = prepared(tmp_path)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    pid = load_prompts(store)[0]["prompt_id"]
    rows = [replace(s, prompt_id=pid) for s in groups(random.Random(0), "a", 1, 0, vocab)]
    evil = [replace(s, sample_id=f"e{i}", input_ids=[*s.input_ids[:-1], vocab]) for i, s in enumerate(rows)]
    store.write_bytes(LAYOUT.ungraded_shard("rollout-0", 0), encode_shard(rows))
    store.write_bytes(LAYOUT.ungraded_shard("rollout-0", 1), encode_shard(evil))
    store.write_json(LAYOUT.done, {"step": 0})  # grade what is there, then stop
    assert run_reward_worker(run_uri, 0)["graded"] == len(rows)
    assert store.exists(LAYOUT.graded_shard("rollout-0", 0)) and not store.exists(LAYOUT.graded_shard("rollout-0", 1))
    reasons = [store.read_json(r)["reason"] for r in store.find(LAYOUT.quarantine_dir, ".json")]
    assert len(reasons) == 1 and f"outside [0, {vocab})" in reasons[0], reasons
