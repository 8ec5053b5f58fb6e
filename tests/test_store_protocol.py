import pyarrow as pa
import pytest

from areal_core.layout import LAYOUT
from areal_core.protocol import (
    SCHEMA_VERSION,
    Sample,
    ShardError,
    decode_shard,
    encode_shard,
    read_shard_or_quarantine,
    write_shard,
)
from areal_core.store import Store


def make_samples(n=3, version=0):
    return [
        Sample(
            sample_id=f"w-g0-{i}",
            group_id="w-g0",
            prompt_id="p0",
            worker_id="w",
            input_ids=[1, 2, 3, 4],
            prompt_len=2,
            loss_mask=[0, 0, 1, 1],
            behav_logprobs=[0.0, 0.0, -0.5, -0.25],
            versions=[-1, -1, version, version + 1],
            reward=None if i == 0 else 1.0,
            meta={"k": i},
        )
        for i in range(n)
    ]


def test_shard_round_trip_keeps_every_field():
    samples = make_samples()
    back = decode_shard(encode_shard(samples))
    assert back == samples
    assert back[0].reward is None and back[1].reward == 1.0
    assert back[0].min_version() == 0


def test_schema_version_is_in_the_arrow_metadata():
    data = encode_shard(make_samples())
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    assert table.schema.metadata[b"areal.schema_version"] == SCHEMA_VERSION.encode()


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda d: d[: len(d) // 2], "not a readable Arrow IPC file"),
        (lambda d: b"garbage" * 10, "not a readable Arrow IPC file"),
        (lambda d: b"", "not a readable Arrow IPC file"),
    ],
)
def test_corrupt_shards_raise_shard_error(mangle, reason):
    with pytest.raises(ShardError, match=reason):
        decode_shard(mangle(encode_shard(make_samples())))


def test_wrong_schema_version_and_bad_lengths_are_rejected():
    table = pa.table({"x": [1]}).replace_schema_metadata({"areal.schema_version": "99"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ShardError, match="schema version '99'"):
        decode_shard(sink.getvalue().to_pybytes())
    bad = make_samples(1)
    bad[0].versions = [0]
    with pytest.raises(ShardError, match="differ in length"):
        encode_shard(bad)


def _quarantine_roundtrip(store: Store):
    good, bad = LAYOUT.graded_shard("w", 0), LAYOUT.graded_shard("w", 1)
    write_shard(store, good, make_samples())
    store.write_bytes(bad, encode_shard(make_samples())[:100])
    assert len(read_shard_or_quarantine(store, good)) == 3
    assert read_shard_or_quarantine(store, bad) is None
    assert not store.exists(bad)
    moved = store.find("quarantine")
    assert any(m.endswith(".arrow") for m in moved)
    reason = store.read_json([m for m in moved if m.endswith(".reason.json")][0])
    assert reason["source"] == bad and "Arrow" in reason["reason"]


def test_quarantine_local(tmp_path):
    _quarantine_roundtrip(Store(str(tmp_path / "run")))


@pytest.mark.s3
def test_quarantine_s3(s3_bucket):
    _quarantine_roundtrip(Store(f"{s3_bucket}/run"))


def _store_basics(store: Store):
    store.write_json("status/a-0.json", {"x": 1})
    store.write_bytes("trajectories/graded/w/00000001.arrow", b"1")
    store.write_bytes("trajectories/graded/w/00000000.arrow", b"0")
    assert store.find("trajectories/graded", ".arrow") == [
        "trajectories/graded/w/00000000.arrow",
        "trajectories/graded/w/00000001.arrow",
    ]
    assert store.read_json("status/a-0.json") == {"x": 1}
    assert store.latest_version() is None
    store.write_text("weights/LATEST", "7")
    assert store.latest_version() == 7
    assert store.find("nothing-here") == []
    assert not store.done()


def test_store_local(tmp_path):
    store = Store(str(tmp_path / "run"))
    _store_basics(store)
    assert not [p for p in (tmp_path / "run").rglob("*.tmp-*")]  # atomic writes leave no temp files


@pytest.mark.s3
def test_store_s3(s3_bucket):
    _store_basics(Store(f"{s3_bucket}/run"))


def test_local_find_lists_what_os_walk_lists(tmp_path):
    """The local listing (one scandir per folder, no relpath per file) names the same files as
    os.walk: hidden files skipped, hidden folders entered, symlinked folders not entered."""
    import os

    for f in ["a/x.arrow", "a/b/y.arrow", "a/b/.t.arrow", "a/b/.h/z.arrow", "c/w.json", "top.arrow"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    os.symlink(tmp_path / "c", tmp_path / "a" / "link")
    store = Store(str(tmp_path))

    def walk(prefix: str, suffix: str) -> list[str]:
        out = []
        for folder, _, files in os.walk(store.path(prefix)):
            out += [os.path.relpath(os.path.join(folder, n), tmp_path) for n in files]
        return sorted(p for p in out if not os.path.basename(p).startswith(".") and p.endswith(suffix))

    for prefix, suffix in [("", ""), ("", ".arrow"), ("a", ""), ("a/b", ".arrow"), ("c", ".json")]:
        assert store.find(prefix, suffix) == walk(prefix, suffix)
    assert store.find("", ".arrow") == ["a/b/.h/z.arrow", "a/b/y.arrow", "a/x.arrow", "top.arrow"]
    assert store.find("missing") == []


def test_local_find_skips_a_folder_removed_while_listing(tmp_path, monkeypatch):
    """A folder deleted between being seen and being read (the trainer prunes weight versions
    while another process lists) is skipped, as os.walk skips it, instead of failing the poll."""
    import os

    for f in ["w/v1/a.bin", "w/v2/b.bin"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    store = Store(str(tmp_path))
    real = os.scandir

    def scandir(path):
        if str(path).endswith("v1"):
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert store.find("w") == ["w/v2/b.bin"]
