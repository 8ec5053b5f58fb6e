"""The run root on fsspec: the only channel between roles.

Layout (DESIGN.md):
    config.yaml, prompts/part-*.parquet, weights/v{N:06d}/ + MANIFEST.json, weights/LATEST,
    trajectories/{ungraded,graded}/{worker}/{seq:08d}.arrow, trainer/checkpoints/step-{N}/,
    status/{role}-{id}.json, quarantine/, DONE

Objects are written whole (local: temp file + rename; S3: one PUT), and a marker written
after them makes a multi-file publication visible. Readers ignore anything unmarked.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec

INIT_MODEL = "init_model"  # the policy RL starts from (after SFT), HF format
FINAL_MODEL = "final_model"  # the trained policy, HF format, written before DONE
DISCARDED_GROUPS = "trainer/discarded_groups.json"  # {"groups": D}: admission given back by the trainer


def weights_dir(version: int) -> str:
    return f"weights/v{version:06d}"


def shard_name(stage: str, worker: str, seq: int) -> str:
    return f"trajectories/{stage}/{worker}/{seq:08d}.arrow"


def normalize_uri(uri: str) -> str:
    """Local paths become absolute `file://` URIs; remote URIs are kept as they are."""
    if "://" in uri:
        if uri.startswith("file://"):
            return "file://" + str(Path(uri[len("file://") :]).resolve())
        return uri.rstrip("/")
    return "file://" + str(Path(uri).resolve())


def storage_options(uri: str) -> dict[str, Any]:
    if uri.startswith("s3://"):
        # Polling needs fresh listings; the endpoint comes from AWS_ENDPOINT_URL when set.
        opts: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        return opts
    return {}


class Store:
    """A run root. All paths given to methods are relative to the root."""

    def __init__(self, uri: str):
        self.uri = normalize_uri(uri)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **storage_options(self.uri))
        self.local = self.uri.startswith("file://")

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url(self, rel: str = "") -> str:
        return f"{self.uri}/{rel}" if rel else self.uri

    def local_path(self, rel: str = "") -> Path:
        if not self.local:
            raise ValueError(f"{self.uri} is not a local store")
        return Path(self.path(rel))

    # -- objects -------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write an object whole: readers see the old object, or the new one, never a part."""
        full = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            tmp = f"{os.path.dirname(full)}/.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, full)
        else:
            self.fs.pipe_file(full, data)

    def read_bytes(self, rel: str) -> bytes:
        if self.local:
            with open(self.path(rel), "rb") as f:
                return f.read()
        return self.fs.cat_file(self.path(rel))

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(self.path(rel))
        return self.fs.exists(self.path(rel))

    def delete(self, rel: str, recursive: bool = False) -> None:
        if self.exists(rel):
            self.fs.rm(self.path(rel), recursive=recursive)

    def move(self, src: str, dst: str) -> None:
        if self.local:
            os.makedirs(os.path.dirname(self.path(dst)), exist_ok=True)
            os.replace(self.path(src), self.path(dst))
        else:
            self.fs.mv(self.path(src), self.path(dst))

    def find(self, prefix: str, suffix: str = "") -> list[str]:
        """All object paths under `prefix` (relative to the root), sorted; hidden temp files skipped."""
        base = self.path(prefix)
        if self.local:
            out = []
            if not os.path.isdir(base):
                return []
            for dirpath, _, files in os.walk(base):
                for name in files:
                    if not name.startswith(".") and name.endswith(suffix):
                        out.append(os.path.relpath(os.path.join(dirpath, name), self.root))
            return sorted(out)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(p[n:] for p in found if p.endswith(suffix) and not p.rsplit("/", 1)[-1].startswith("."))

    def listdir(self, prefix: str) -> list[str]:
        """Names directly under `prefix` (files and folders), sorted."""
        base = self.path(prefix)
        if self.local:
            return sorted(n for n in os.listdir(base) if not n.startswith(".")) if os.path.isdir(base) else []
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        except FileNotFoundError:
            return []

    def put_dir(self, local_dir: str | Path, rel: str) -> None:
        for path in sorted(Path(local_dir).rglob("*")):
            if path.is_file():
                self.write_bytes(f"{rel}/{path.relative_to(local_dir).as_posix()}", path.read_bytes())

    def get_dir(self, rel: str, local_dir: str | Path) -> None:
        for name in self.find(rel):
            dst = Path(local_dir) / os.path.relpath(name, rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(self.read_bytes(name))

    # -- markers and status ----------------------------------------------------------------
    def done(self) -> bool:
        return self.exists("DONE")

    def latest_version(self) -> int | None:
        try:
            return int(self.read_text("weights/LATEST").strip())
        except (FileNotFoundError, ValueError):
            return None

    def discarded_groups(self) -> int:
        """Groups the trainer discarded untrained (they give their admission back); 0 if none yet."""
        try:
            return int(self.read_json(DISCARDED_GROUPS)["groups"])
        except (FileNotFoundError, KeyError, TypeError, ValueError):
            return 0

    def heartbeat(self, role: str, worker_id: str, **counters: Any) -> None:
        self.write_json(
            f"status/{role}-{worker_id}.json", {"role": role, "id": worker_id, "time": time.time(), **counters}
        )

    def statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name in self.find("status", ".json"):
            try:
                out[name.rsplit("/", 1)[-1][:-5]] = self.read_json(name)
            except (json.JSONDecodeError, FileNotFoundError):
                continue
        return out
