"""The run root's Layout (areal_core/layout.py): no store path spelled outside it, and folders that
move with fsspec's batched put/get/copy (server-side on S3) with their markers written last."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from areal_core.layout import LAYOUT, Layout
from areal_core.store import Store
from tests.conftest import ROOT

SCANNED = ("areal_core", "tasks", "workflows")


def _layout_strings() -> list[str]:
    return [v for k, v in vars(Layout).items() if not k.startswith("_") and isinstance(v, str)]


def _folders() -> set[str]:
    """Top-level folder names of the run root."""
    out = {v.split("/")[0] for v in _layout_strings() if "/" in v}
    out |= {v for k, v in vars(Layout).items() if k.endswith(("_dir", "_root")) and isinstance(v, str) and "/" not in v}
    return out | {LAYOUT.init_model, LAYOUT.final_model}


def _file_names() -> set[str]:
    """File names the Layout defines (config.yaml, DONE, MANIFEST.json, metrics.jsonl, ...)."""
    names = {v.rsplit("/", 1)[-1] for v in _layout_strings()}
    return {n for n in names if "." in n or n.isupper()}


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }


def store_path_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant (f-string parts included) in `path` that spells a store
    path: starts with a top-level folder of the Layout and "/", or is one of its file names (a
    leading "/" allowed: f"{folder}/COMMITTED")."""
    folders, names = _folders(), _file_names()
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        s = node.value
        if s.lstrip("/") in names or any(s.startswith(f"{f}/") for f in folders):
            out.append((node.lineno, s))
    return sorted(out)


def test_layout_names_the_top_level_of_the_design():
    assert {"prompts", "weights", "trajectories", "trainer", "status", "quarantine"} <= _folders()
    assert {"config.yaml", "DONE", "tracking.json", "MANIFEST.json", "LATEST", "COMMITTED"} <= _file_names()


def test_no_store_path_literal_outside_layout_py():
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("areal_core/layout.py", "areal_core/store.py"):
                continue
            found += [f"{rel}:{line}: {text!r}" for line, text in store_path_literals(path)]
    assert not found, "store paths spelled outside areal_core/layout.py (use LAYOUT):\n" + "\n".join(found)


def test_the_grep_catches_literals(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        '"""weights/v1 in a docstring is fine."""\n'
        'a = "trajectories/graded"\n'
        'b = f"trainer/trained/step-{1}.json"\n'
        'c = "DONE"\n'
        'e = f"{x}/COMMITTED"\n'
        'd = "trainer"\n'  # a role name, not a path
    )
    assert [line for line, _ in store_path_literals(src)] == [2, 3, 4, 5]


def test_layout_paths():
    assert LAYOUT.graded_shard("w", 3) == "trajectories/graded/w/00000003.arrow"
    assert LAYOUT.graded_twin(LAYOUT.ungraded_shard("w", 3)) == LAYOUT.graded_shard("w", 3)
    assert LAYOUT.ungraded_twin(LAYOUT.graded_shard("w", 3)) == LAYOUT.ungraded_shard("w", 3)
    assert LAYOUT.shard_worker_seq(LAYOUT.graded_shard("proxy-0", 41)) == ("proxy-0", 41)
    assert LAYOUT.manifest(2) == "weights/v000002/MANIFEST.json"
    assert LAYOUT.weights_version("v000012") == 12 and LAYOUT.weights_version("LATEST") is None
    assert LAYOUT.checkpoint_step("step-000007") == 7 and LAYOUT.checkpoint_step("tmp") is None
    assert LAYOUT.committed(LAYOUT.checkpoint_dir(7)) == "trainer/checkpoints/step-000007/COMMITTED"
    assert LAYOUT.status("trainer", "0") == "status/trainer-0.json"
    assert LAYOUT.quarantined("trajectories/graded/w/1.arrow") == "quarantine/trajectories__graded__w__1.arrow"
    assert LAYOUT.init_model not in LAYOUT.run_state and LAYOUT.config not in LAYOUT.run_state
    assert {LAYOUT.weights_root, LAYOUT.done, LAYOUT.final_model} <= set(LAYOUT.run_state)


# -- folders -----------------------------------------------------------------------------------
BIG = 6 * 2**20 + 123  # above S3's 5 MiB minimum part size


def make_folder(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b"{}",
        "tokenizer/vocab.txt": b"a\nb\n",
        "deep/er/still/x.bin": os.urandom(1000),
        "model.safetensors": os.urandom(BIG),
        LAYOUT.committed_name: b"1",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_folder(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def record_batches(monkeypatch, store: Store, op: str) -> list[list[str]]:
    """Spy on the batched fsspec transfer `op` of `store`: the destination names of each call."""
    calls: list[list[str]] = []
    real = getattr(store.fs, op)

    def spy(srcs, dsts, *a, **kw):  # a local destination is written as '.{name}.tmp-{hex}', then renamed
        calls.append([re.sub(r"^\.(.*)\.tmp-[0-9a-f]{32}$", r"\1", d.rsplit("/", 1)[-1]) for d in dsts])
        return real(srcs, dsts, *a, **kw)

    monkeypatch.setattr(store.fs, op, spy)
    return calls


def _round_trip(store: Store, other: Store, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "src"
    files = make_folder(src)
    puts = record_batches(monkeypatch, store, "put")
    store.put_dir(src, LAYOUT.init_model)
    assert puts == [[n for n in puts[0] if n != LAYOUT.committed_name], [LAYOUT.committed_name]]  # marker last
    assert len(puts[0]) == len(files) - 1
    assert sorted(store.find(LAYOUT.init_model)) == sorted(f"{LAYOUT.init_model}/{n}" for n in files)

    store.get_dir(LAYOUT.init_model, tmp_path / "back")
    assert read_folder(tmp_path / "back") == files

    copies = record_batches(monkeypatch, store, "copy")
    store.copy_dir(LAYOUT.init_model, LAYOUT.final_model)
    assert copies[-1] == [LAYOUT.committed_name] and len(copies) == 2
    store.get_dir(LAYOUT.final_model, tmp_path / "copied")
    assert read_folder(tmp_path / "copied") == files
    assert store.read_bytes(f"{LAYOUT.init_model}/model.safetensors") == files["model.safetensors"]

    other.copy_dir(LAYOUT.init_model, LAYOUT.init_model, source=store)  # another run root
    other.get_dir("", tmp_path / "whole")  # "" = the whole root
    assert read_folder(tmp_path / "whole") == {f"{LAYOUT.init_model}/{n}": d for n, d in files.items()}

    store.put_dir(tmp_path / "empty-does-not-exist", "nothing")  # an empty folder is a no-op
    store.copy_dir("nothing", "still-nothing")
    assert store.find("still-nothing") == []


def test_folders_local(tmp_path, monkeypatch):
    _round_trip(Store(str(tmp_path / "run")), Store(str(tmp_path / "run2")), tmp_path, monkeypatch)
    assert not list((tmp_path / "run").rglob("*.tmp-*")) and not list((tmp_path / "run2").rglob("*.tmp-*"))


@pytest.mark.s3
def test_folders_s3(s3_bucket, tmp_path, monkeypatch):
    store = Store(f"{s3_bucket}/run")
    _round_trip(store, Store(f"{s3_bucket}/run2"), tmp_path, monkeypatch)


@pytest.mark.s3
def test_copy_dir_on_s3_is_server_side(s3_bucket, tmp_path, monkeypatch):
    store = Store(f"{s3_bucket}/run")
    files = make_folder(tmp_path / "src")
    store.put_dir(tmp_path / "src", LAYOUT.init_model)

    def no_download(*a, **kw):
        raise AssertionError("copy_dir downloaded an object")

    for name in ("_cat_file", "_get_file", "open"):
        monkeypatch.setattr(store.fs, name, no_download)
    store.copy_dir(LAYOUT.init_model, LAYOUT.final_model)
    monkeypatch.undo()
    store.get_dir(LAYOUT.final_model, tmp_path / "back")
    assert read_folder(tmp_path / "back") == files


@pytest.mark.s3
def test_local_copy_between_filesystems(tmp_path, s3_bucket):
    """A local run root taking a folder from S3 (a cached SFT checkpoint elsewhere) goes through a temp folder."""
    remote = Store(f"{s3_bucket}/cache")
    files = make_folder(tmp_path / "src")
    remote.put_dir(tmp_path / "src", LAYOUT.init_model)
    local = Store(str(tmp_path / "run"))
    local.copy_dir(LAYOUT.init_model, LAYOUT.init_model, source=remote)
    assert read_folder(local.local_path(LAYOUT.init_model)) == files


def test_ensure_init_model_copies_a_cached_sft_checkpoint(tmp_path):
    from areal_core.run.pipeline import ensure_init_model

    cache, run = Store(str(tmp_path / "cache")), Store(str(tmp_path / "run"))
    files = make_folder(tmp_path / "src")
    cache.put_dir(tmp_path / "src", LAYOUT.init_model)
    ensure_init_model(run, cache.url(LAYOUT.init_model))
    assert read_folder(run.local_path(LAYOUT.init_model)) == files
    # a cached checkpoint whose folder is gone is recomputed: tests/test_flyte.py
