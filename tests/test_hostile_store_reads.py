"""Hostile objects in the store, second round: values a shard's schema admits but the trainer must
not train on (null elements, loss_mask values other than 0/1, JSON nested past the stack), files
that are not what their name says (a FIFO, a link to /dev/zero, a sparse giant), quarantine names
that are too long or could collide, weights and checkpoints whose manifest is crafted or gone, and
counters that are not counts. Each is refused with a reason; nothing hangs, crashes or trains."""

from __future__ import annotations

import json
import os
import threading

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.protocol import SCHEMA, ShardError, decode_shard, read_shard_or_quarantine, to_table
from areal_core.store import Store, UnreadableObject
from areal_core.train import checkpoint
from areal_core.weights import WEIGHTS_FILE, WeightsError, sha256
from areal_core.weights.reader import load_state_dict, read_manifest, stage_verified
from tests.test_hostile_store import ipc, sample

DEEP = "[" * 100_000 + "]" * 100_000


def shard_with(name: str, values: pa.Array) -> bytes:
    """One valid sample's shard with column `name` replaced by `values` (its type kept)."""
    table = to_table([sample(0)])
    cols = {n: table[n] for n in SCHEMA.names}
    cols[name] = values
    return ipc(pa.table(cols, schema=SCHEMA))


ints = pa.list_(pa.int32())
BAD_VALUES = {
    "a null token id": ("input_ids", pa.array([[5, None, 7, 8]], ints), "input_ids holds a null"),
    "a null version": ("versions", pa.array([[-1, -1, None, 0]], ints), "versions holds a null"),
    "a null loss_mask value": ("loss_mask", pa.array([[0, 0, None, 1]], pa.list_(pa.int8())), "loss_mask holds a null"),
    "a null log-prob": ("behav_logprobs", pa.array([[0, 0, None, 0]], pa.list_(pa.float32())), "behav_logprobs holds"),
    "loss_mask 2": ("loss_mask", pa.array([[0, 0, 2, 1]], pa.list_(pa.int8())), "other than 0 or 1"),
    "loss_mask -128": ("loss_mask", pa.array([[0, 0, -128, 1]], pa.list_(pa.int8())), "other than 0 or 1"),
    "no sample_id": ("sample_id", pa.array([None], pa.string()), "without sample_id"),
    "no worker_id": ("worker_id", pa.array([None], pa.string()), "without worker_id"),
    "no versions list": ("versions", pa.array([None], ints), "without versions"),
    "meta nested 100k deep": ("meta", pa.array([DEEP], pa.string()), "nested too deeply"),
    "reward_info nested 100k deep": ("reward_info", pa.array(['{"a":' * 50_000 + "1" + "}" * 50_000]), "too deeply"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_the_schema_admits_but_the_trainer_must_not_use_are_refused(case):
    name, values, why = BAD_VALUES[case]
    with pytest.raises(ShardError, match=why):
        decode_shard(shard_with(name, values))


def test_a_deeply_nested_shard_is_quarantined_and_the_next_one_read(tmp_path):
    store = Store(str(tmp_path))
    bad, good = LAYOUT.graded_shard("w", 1), LAYOUT.graded_shard("w", 2)
    store.write_bytes(bad, shard_with("meta", pa.array([DEEP], pa.string())))
    store.write_bytes(good, ipc(to_table([sample(0)])))
    assert read_shard_or_quarantine(store, bad) is None
    assert (
        not store.exists(bad)
        and "nested" in store.read_json(LAYOUT.quarantine_reason(LAYOUT.quarantined(bad)))["reason"]
    )
    assert [s.sample_id for s in read_shard_or_quarantine(store, good)] == ["s0"]


def test_a_fifo_a_link_to_dev_zero_and_a_sparse_giant_are_quarantined_without_reading_them(tmp_path):
    store = Store(str(tmp_path))
    fifo, zero, giant = (LAYOUT.graded_shard("w", i) for i in (1, 2, 3))
    os.makedirs(os.path.dirname(store.path(fifo)))
    os.mkfifo(store.path(fifo))
    os.symlink("/dev/zero", store.path(zero))
    with open(store.path(giant), "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of holes: reading it whole would take 1 GiB of memory
    results: list = []
    reader = threading.Thread(
        target=lambda: results.extend(read_shard_or_quarantine(store, r) for r in (fifo, zero, giant))
    )
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "reading a FIFO named like a shard blocked"
    assert results == [None, None, None]
    reasons = [store.read_json(LAYOUT.quarantine_reason(LAYOUT.quarantined(r)))["reason"] for r in (fifo, zero, giant)]
    assert "not a regular file" in reasons[0] and "not a regular file" in reasons[1]
    assert f"{1 << 30} bytes" in reasons[2]
    store.write_bytes("small.json", b"x" * 11)
    assert store.read_bytes("small.json", 11) == b"x" * 11
    with pytest.raises(UnreadableObject, match="at most 10"):
        store.read_bytes("small.json", 10)


def test_quarantine_names_never_collide_and_fit_a_file_system(tmp_path):
    store = Store(str(tmp_path))
    twins = ["trajectories/graded/a__b/1.arrow", "trajectories/graded/a/b__1.arrow"]
    deep = "trajectories/graded/" + "/".join(["x" * 100] * 3) + "/1.arrow"
    for rel in twins + [deep]:
        store.write_bytes(rel, b"not arrow")
        assert read_shard_or_quarantine(store, rel) is None
    names = {LAYOUT.quarantined(r) for r in twins + [deep]}
    assert len(names) == 3 and all(len(n.rsplit("/", 1)[1].encode()) <= 200 for n in names)
    assert sorted(store.read_json(LAYOUT.quarantine_reason(n))["source"] for n in names) == sorted(twins + [deep])
    assert LAYOUT.quarantined("trajectories/graded/w/1.arrow") == "quarantine/trajectories__graded__w__1.arrow"


def publish(store: Store, version: int, files: dict[str, bytes], manifest: object = None) -> None:
    for name, data in files.items():
        if name:
            store.write_bytes(LAYOUT.weights_file(version, name), data)
    if manifest is None:
        manifest = {"version": version, "files": {n: sha256(d) for n, d in files.items()}}
    store.write_bytes(
        LAYOUT.manifest(version), manifest.encode() if isinstance(manifest, str) else json.dumps(manifest).encode()
    )


def lying_header() -> bytes:
    """A safetensors file whose header says its tensor spans 2^62 bytes."""
    real = st_save({"w": torch.zeros(2)})
    n = int.from_bytes(real[:8], "little")
    header = json.loads(real[8 : 8 + n])
    header["w"]["shape"], header["w"]["data_offsets"] = [2**60], [0, 2**62]
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + real[8 + n :]


def test_crafted_weights_are_refused_with_a_weights_error(tmp_path):
    store = Store(str(tmp_path / "run"))
    publish(store, 1, {}, '{"files": ' * 50_000 + "1" + "}" * 50_000)
    with pytest.raises(WeightsError, match="sane size and depth"):
        read_manifest(store, 1)
    publish(store, 2, {WEIGHTS_FILE: lying_header()})  # the manifest matches the lying file
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        load_state_dict(store, 2)
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        stage_verified(store, 2, tmp_path / "staging")
    good = st_save({"w": torch.zeros(2)})
    publish(store, 3, {WEIGHTS_FILE: good, "": b""})
    with pytest.raises(WeightsError, match="unsafe file"):
        stage_verified(store, 3, tmp_path / "staging")
    assert not [p for p in (tmp_path / "staging").iterdir() if not p.name.startswith(".")]  # nothing staged


def test_a_checkpoint_whose_manifest_was_removed_does_not_verify(tmp_path):
    store = Store(str(tmp_path))
    store.write_bytes(LAYOUT.checkpoint_file(4, "state.json"), b"{}")
    assert checkpoint.verify(store, 4) == ["no MANIFEST.json"]


@pytest.mark.parametrize("text", ['{"groups": 1e300}', '{"groups": -1000000}', '{"groups": true}', DEEP, "\xff"])
def test_a_discarded_groups_file_that_is_not_a_count_counts_nothing(tmp_path, text):
    store = Store(str(tmp_path))
    store.write_bytes(LAYOUT.discarded_groups, text.encode("latin-1"))
    assert store.discarded_groups() == 0
    store.write_json(LAYOUT.discarded_groups, {"groups": 3})
    assert store.discarded_groups() == 3


@pytest.mark.parametrize("data", [DEEP.encode(), b"\xff\xfe", b" " * ((1 << 20) + 1)])
def test_a_status_file_that_cannot_be_read_is_skipped(tmp_path, data):
    store = Store(str(tmp_path))
    store.write_bytes(LAYOUT.status("rollout", "0"), data)
    store.heartbeat("reward", "0")
    assert list(store.statuses()) == [LAYOUT.status("reward", "0").rsplit("/", 1)[1][: -len(".json")]]


def test_every_reader_of_a_file_that_is_not_regular_refuses_it_in_its_own_terms(tmp_path):
    from areal_core.config import ConfigError
    from areal_core.context import load_run_config
    from areal_core.manifest import MANIFEST_NAME, make_manifest
    from areal_core.protocol import shard_rows
    from areal_core.vlm.images import ImageError, read_image_bytes

    store = Store(str(tmp_path))

    def fifo(rel: str) -> None:
        os.makedirs(os.path.dirname(store.path(rel)), exist_ok=True)
        os.mkfifo(store.path(rel))

    fifo(LAYOUT.quarantined(LAYOUT.graded_shard("w", 1)))
    assert shard_rows(store, LAYOUT.quarantined(LAYOUT.graded_shard("w", 1))) == 0  # the online source's count
    sha = "ab" * 32
    fifo(LAYOUT.image(sha))
    with pytest.raises(ImageError, match="not a regular file"):
        read_image_bytes(store, sha)
    good = st_save({"w": torch.zeros(2)})
    publish(store, 5, {WEIGHTS_FILE: good})
    os.unlink(store.path(LAYOUT.weights_file(5, WEIGHTS_FILE)))
    fifo(LAYOUT.weights_file(5, WEIGHTS_FILE))
    with pytest.raises(WeightsError, match="not a regular file"):
        load_state_dict(store, 5)
    store.write_bytes(LAYOUT.checkpoint_file(6, "state.json"), b"{}")
    store.write_json(LAYOUT.checkpoint_file(6, MANIFEST_NAME), make_manifest({"state.json": b"{}"}, step=6))
    assert checkpoint.verify(store, 6) == []
    os.unlink(store.path(LAYOUT.checkpoint_file(6, "state.json")))
    fifo(LAYOUT.checkpoint_file(6, "state.json"))
    assert checkpoint.verify(store, 6)  # skipped for an older checkpoint, not a crash
    store.write_bytes(LAYOUT.checkpoint_file(6, MANIFEST_NAME), DEEP.encode())
    assert "does not parse" in checkpoint.verify(store, 6)[0]
    with open(store.path(LAYOUT.config), "wb") as f:
        f.truncate((1 << 20) + 1)
    with pytest.raises(ConfigError, match="at most"):
        load_run_config(store)


def test_every_shard_reader_refuses_a_fifo_as_a_bad_shard(tmp_path):
    from areal_core.protocol import read_shard
    from areal_core.reward.labels import read_graded

    store = Store(str(tmp_path))
    rel = LAYOUT.graded_shard("w", 1)
    os.makedirs(os.path.dirname(store.path(rel)))
    os.mkfifo(store.path(rel))
    store.write_bytes(LAYOUT.graded_shard("w", 2), ipc(to_table([sample(0)])))
    with pytest.raises(ShardError, match="not a regular file"):
        read_shard(store, rel)
    samples, bad = read_graded(store)  # what preference export and labels read: skipped and counted
    assert [s.sample_id for s in samples] == ["s0"] and bad == 1


def test_a_bounded_read_on_s3_fetches_at_most_one_byte_past_the_limit(s3_bucket):
    store, rel = Store(s3_bucket), LAYOUT.status("rollout", "0")
    store.write_bytes(rel, b"x" * 5000)
    assert store.read_bytes(rel, 5000) == b"x" * 5000
    with pytest.raises(UnreadableObject, match="more than 4999 bytes"):
        store.read_bytes(rel, 4999)
    assert store.read_bytes(rel) == b"x" * 5000


@pytest.mark.parametrize("missing", ["one of two rows", "every row"])
def test_a_graded_shard_with_a_row_that_has_no_reward_is_quarantined_not_trained_as_zero(tmp_path, missing):
    from areal_core.config import RunConfig
    from areal_core.events import EventLog
    from areal_core.protocol import write_shard
    from areal_core.train.checkpoint import TrainerState
    from areal_core.train.sources import GradedShards

    store = Store(str(tmp_path))
    bad = [sample(0), sample(1)]
    for s in bad[: 1 if missing == "one of two rows" else 2]:
        s.reward = None
    write_shard(store, LAYOUT.graded_shard("rollout-0", 0), bad)
    write_shard(store, LAYOUT.graded_shard("rollout-0", 1), [sample(2), sample(3)])
    source = GradedShards(store, RunConfig(), TrainerState(), EventLog(None, "trainer", "0"))
    assert source.ingest(0) == 2
    assert source.counters.quarantined_shards == 1
    assert sorted(s.sample_id for s in source.pending()) == ["s2", "s3"]
    (reason,) = store.find(LAYOUT.quarantine_dir, ".reason.json")
    assert "has no reward" in store.read_json(reason)["reason"]
