"""Verified staging of a published weight version for engines that load from disk (vLLM, SGLang).

A remote engine reads an HF folder from its own file system, so the rollout worker first
copies `weights/v{N}/` out of the store into a local staging folder, checking every file
against the sha256 in `MANIFEST.json` as it goes. Only a folder whose files all match is
made visible (written under a temporary name, then renamed), so the engine never loads
bytes that failed their check, whichever store (local folder, S3) the run uses. A
delta-published version (`model.delta`) is staged as the model.safetensors rebuilt from it
and checked against the sha256 its manifest records for the rebuilt file.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from areal_core.store import Store, weights_dir
from areal_core.train.weights import (
    DELTA_FILE,
    MANIFEST,
    WEIGHTS_FILE,
    WeightsError,
    delta_base,
    load_weights_bytes,
    sha256,
)


def read_manifest(store: Store, version: int) -> dict:
    """The manifest of a published version; WeightsError if it is missing or malformed."""
    base = weights_dir(version)
    try:
        manifest = store.read_json(f"{base}/{MANIFEST}")
    except FileNotFoundError:
        raise WeightsError(f"weights v{version} incomplete: no {MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WeightsError(f"weights v{version}: {MANIFEST} is not JSON") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or (WEIGHTS_FILE not in files and DELTA_FILE not in files):
        raise WeightsError(f"weights v{version}: {MANIFEST} lists no {WEIGHTS_FILE}")
    if manifest.get("version") != version:
        raise WeightsError(f"weights v{version}: {MANIFEST} names version {manifest.get('version')!r}")
    return manifest


def stage_verified(store: Store, version: int, staging_root: str | Path) -> Path:
    """Copy weights/v{version}/ to `staging_root/v{version:06d}` with every file's sha256 checked.

    Returns the staged folder (an HF checkpoint: safetensors, config, tokenizer files).
    Raises WeightsError, leaving nothing staged, when a file is missing or fails its check.
    """
    manifest = read_manifest(store, version)
    root = Path(staging_root)
    final = root / f"v{version:06d}"
    if (final / MANIFEST).is_file():
        return final  # staged and verified before
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        base = weights_dir(version)
        for name, digest in sorted(manifest["files"].items()):
            if "/" in name or name.startswith("."):
                raise WeightsError(f"weights v{version}: {MANIFEST} names an unsafe file {name!r}")
            if name == DELTA_FILE:  # rebuilt, every file checked: from the staged base or the full snapshot
                (tmp / WEIGHTS_FILE).write_bytes(_rebuild(store, version, manifest, root))
                continue
            try:
                data = store.read_bytes(f"{base}/{name}")
            except FileNotFoundError:
                raise WeightsError(f"weights v{version} incomplete: {name} is missing") from None
            if sha256(data) != digest:
                raise WeightsError(f"weights v{version}: {name} fails its sha256 check")
            (tmp / name).write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _rebuild(store: Store, version: int, manifest: dict, root: Path) -> bytes:
    """model.safetensors of a delta-published version, from the base version's staged file when it
    is still staged (one delta to apply), else from the store's full snapshot and deltas."""
    base = delta_base(manifest)
    staged = root / f"v{base:06d}" if isinstance(base, int) else None
    if staged is not None and (staged / MANIFEST).is_file() and (staged / WEIGHTS_FILE).is_file():
        try:
            return load_weights_bytes(store, version, have=(base, (staged / WEIGHTS_FILE).read_bytes()))
        except WeightsError:
            pass  # a staged file that does not rebuild this version: from the store alone
    return load_weights_bytes(store, version)


def prune_staged(staging_root: str | Path, keep: set[int]) -> None:
    """Remove staged versions not in `keep`."""
    root = Path(staging_root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        name = path.name
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) not in keep:
            shutil.rmtree(path, ignore_errors=True)
