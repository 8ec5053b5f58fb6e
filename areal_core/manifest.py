"""MANIFEST.json: the sha256 of every file of a stored object, written after the files and
before the object is made visible; a reader checks each file against it before trusting it.
Published weights (weights/v{N}/), checkpoints (trainer/checkpoints/step-{N}/) and init_model/
carry one, in this one format: {"files": {name: sha256 hex}, "time": unix seconds, ...}."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from areal_core.layout import LAYOUT

MANIFEST_NAME = LAYOUT.manifest_name


class ManifestError(RuntimeError):
    """A stored object whose files are missing or fail their checksums."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_manifest(files: Mapping[str, bytes], **extra: Any) -> dict[str, Any]:
    return {**extra, "files": {name: sha256(data) for name, data in files.items()}, "time": time.time()}


def failures(manifest: dict[str, Any], read: Callable[[str], bytes | None]) -> list[str]:
    """The files of `manifest` that `read(name)` cannot give (None) or that fail their sha256."""
    out = []
    for name, digest in manifest.get("files", {}).items():
        data = read(name)
        if data is None:
            out.append(f"{name} is missing")
        elif sha256(data) != digest:
            out.append(f"{name} fails its sha256 check")
    return out


def write_local_manifest(folder: str | Path) -> None:
    """Write MANIFEST.json over every file of a local folder (before it is copied to a store)."""
    root = Path(folder)
    files = {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    (root / MANIFEST_NAME).write_text(json.dumps(make_manifest(files), indent=1))


def verify_local_dir(folder: str | Path) -> bool:
    """Check a local folder against its MANIFEST.json; False when it has none; ManifestError when
    a file is missing or fails its checksum."""
    root = Path(folder)
    path = root / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not a readable manifest ({exc})") from None

    def read(name: str) -> bytes | None:
        file = root / name
        return file.read_bytes() if "/" not in name and file.is_file() else None

    bad = failures(manifest, read)
    if bad:
        raise ManifestError(f"{root}: {'; '.join(bad[:3])}")
    return True
