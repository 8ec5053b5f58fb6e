"""Temporary files (issue 24): a local write that fails (ENOSPC, EIO) leaves no temporary file
behind, whichever step fails; a role removes the stale temporary files a killed writer left, its
own naming pattern only and only once they are old, never another live writer's."""

from __future__ import annotations

import errno
import io
import os
import time
from pathlib import Path

import pytest

import areal_core.store as store_module
from areal_core.layout import LAYOUT
from areal_core.store import TEMP_STALE_S, Store


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def leftovers(root: Path) -> list[str]:
    """Every hidden file under `root`: the store's temporary and lock files are all hidden."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(".*") if p.is_file())


class HalfWritten(io.BytesIO):
    """A file whose write puts half the bytes on disk and then fails as a full disk does."""

    def __init__(self, path: str):
        super().__init__()
        self.real = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, data) -> int:
        self.real.write(bytes(data[: len(data) // 2]))
        self.real.flush()
        enospc()

    def close(self) -> None:
        self.real.close()
        super().close()


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(str(tmp_path / "run"), retry_s=0)


def test_a_write_that_fails_midway_leaves_no_temporary_file(store, tmp_path, monkeypatch):
    store.write_text("status/a.json", "old")
    monkeypatch.setattr(store_module, "open", lambda path, mode="r": HalfWritten(path), raising=False)
    with pytest.raises(OSError, match="No space left"):
        store.write_bytes("status/a.json", b"x" * 10_000)
    with pytest.raises(OSError, match="No space left"):
        store.write_bytes("status/new.json", b"y" * 10_000)
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    assert store.read_text("status/a.json") == "old" and not store.exists("status/new.json")


@pytest.mark.parametrize("step", ["replace", "write", "fsync-like close"])
def test_a_write_whose_rename_or_write_fails_leaves_no_temporary_file(store, tmp_path, monkeypatch, step):
    store.write_text("a.txt", "old")
    if step == "replace":
        monkeypatch.setattr(store_module.os, "replace", enospc)
    elif step == "write":
        monkeypatch.setattr(store_module, "open", lambda *a, **k: HalfWritten(a[0]), raising=False)
    else:

        class FailsOnClose(io.BytesIO):
            def __init__(self, path):
                super().__init__()
                self.path = path
                Path(path).write_bytes(b"partial")

            def __exit__(self, *exc):
                enospc()

        monkeypatch.setattr(store_module, "open", lambda *a, **k: FailsOnClose(a[0]), raising=False)
    with pytest.raises(OSError) as err:
        store.write_text("a.txt", "new")
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    assert store.read_text("a.txt") == "old"


def test_a_conditional_write_that_fails_leaves_no_temporary_or_lock_file(store, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module.os, "replace", enospc)
    with pytest.raises(OSError, match="No space left"):
        store.write_if("lineage/request.json", b"{}", None)
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    assert store.write_if("lineage/request.json", b"{}", None)  # and the next attempt is not locked out


def _folder(root: Path) -> Path:
    src = root / "src"
    for name, data in {"a.bin": os.urandom(5000), "sub/b.bin": b"b", LAYOUT.committed_name: b""}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    return src


def _fails_after_one(real):
    """A batched fsspec transfer that lands its first file and then hits a full disk."""

    def op(srcs, dsts, *a, **kw):
        real(srcs[:1], dsts[:1], *a, **kw)
        Path(dsts[1] if len(dsts) > 1 else dsts[0]).write_bytes(b"partial")
        enospc()

    return op


@pytest.mark.parametrize("how", ["put_dir", "copy_dir", "get_dir"])
def test_a_folder_transfer_that_fails_leaves_no_temporary_file_and_no_marker(store, tmp_path, monkeypatch, how):
    src = _folder(tmp_path)
    if how != "put_dir":
        store.put_dir(src, LAYOUT.init_model)
    op = {"put_dir": "put", "copy_dir": "copy", "get_dir": "get"}[how]
    monkeypatch.setattr(store.fs, op, _fails_after_one(getattr(store.fs, op)))
    dest = tmp_path / "back"
    with pytest.raises(OSError, match="No space left"):
        if how == "put_dir":
            store.put_dir(src, LAYOUT.init_model)
        elif how == "copy_dir":
            store.copy_dir(LAYOUT.init_model, LAYOUT.final_model)
        else:
            store.get_dir(LAYOUT.init_model, dest)
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    if how == "put_dir":
        assert not store.exists(LAYOUT.committed(LAYOUT.init_model))  # never visible as a whole folder
    if how == "copy_dir":
        assert not store.exists(LAYOUT.committed(LAYOUT.final_model))
    if how == "get_dir":
        assert not (dest / LAYOUT.committed_name).exists()
    # no destination holds a partial file: whatever landed is whole
    landed = {"put_dir": tmp_path / "run" / LAYOUT.init_model, "copy_dir": tmp_path / "run" / LAYOUT.final_model}
    where = landed.get(how, dest)
    for path in where.rglob("*") if where.exists() else []:
        if path.is_file():
            assert path.read_bytes() == (src / path.relative_to(where)).read_bytes()


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_clean_temp_removes_only_stale_files_of_its_own_pattern(store, tmp_path):
    root = tmp_path / "run"
    folder = root / "trajectories" / "ungraded" / "rollout-0"
    folder.mkdir(parents=True)
    hexes = "0123456789abcdef" * 2
    stale = [
        folder / f".00000001.arrow.tmp-{hexes}",
        folder / f".tmp-{hexes}",  # the name of an older store
        root / "status" / f".rollout-0.json.tmp-{hexes}",
        root / "lineage" / ".request.json.lock",
    ]
    fresh = [folder / f".00000002.arrow.tmp-{'f' * 32}"]  # a live writer's: young
    foreign = [
        folder / ".env",
        folder / ".tmp-notours",
        folder / f".tmp-{hexes}x",
        folder / f"visible.tmp-{hexes}",
        folder / "00000000.arrow",
        root / ".git" / "HEAD",
    ]
    for path in stale + fresh + foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    for path in stale + foreign:
        _age(path, TEMP_STALE_S + 60)
    assert store.clean_temp(*LAYOUT.own_folders("rollout", 0)) == 2  # its own folder only
    assert not any(p.exists() for p in stale[:2]) and all(p.exists() for p in stale[2:])
    assert store.clean_temp("") == 2  # the trainer's sweep: the whole root
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in fresh + foreign)
    assert store.clean_temp("", older_than_s=0) == 1 and not fresh[0].exists()
    assert store.clean_temp("does/not/exist") == 0
    assert Store("s3://bucket/run").clean_temp("") == 0  # an object store has no temporary files


def test_a_role_cleans_its_stale_temporary_files_at_start(tmp_path, monkeypatch):
    from areal_core.run import roles

    root = tmp_path / "run"
    stale = root / "weights" / f".model.safetensors.tmp-{'a' * 32}"
    young = root / "weights" / f".model.safetensors.tmp-{'b' * 32}"
    for path in (stale, young):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    _age(stale, TEMP_STALE_S + 1)
    monkeypatch.setattr(roles, "trainer_role", lambda run_uri: {"ran": run_uri})
    assert roles.run_role("trainer", str(root)) == {"ran": str(root)}
    assert not stale.exists() and young.exists()
