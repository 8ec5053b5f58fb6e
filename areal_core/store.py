"""The run root on fsspec: the only channel between roles (paths named by `LAYOUT`, areal_core/layout.py).

Objects are written whole (local: temp file + rename; S3: one PUT), and a marker written after them makes a
multi-file publication visible. Readers ignore anything unmarked. Folders move with fsspec's batched put/get/copy
(concurrent; server-side copy on S3), markers last; a file that lands on a local disk lands under a temporary name
first and is renamed when whole.
A temporary file (`.{name}.tmp-<32 hex>`) is removed when its write fails (ENOSPC, ...), and one left by a
killed writer is removed by `clean_temp`, which every role runs on its own folders at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec

from areal_core.layout import LAYOUT, inside
from areal_core.retry import POLICY, RetryPolicy, retried


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
        # A refused connection fails fast; the Store's retry window (areal_core/retry.py) waits.
        opts: dict[str, Any] = {
            "use_listings_cache": False,
            "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 5, "retries": {"total_max_attempts": 1}},
        }
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        return opts
    return {}


TEMP_STALE_S = 3600.0  # a temporary file this old belongs to no live writer (a write takes seconds)
_TEMP_NAME = re.compile(r"\.(.*\.)?tmp-[0-9a-f]{32}|\..+\.lock")  # the store's own names, nothing else

SMALL_JSON_BYTES = 1 << 20  # a status or counter file: a few fields
MAX_JSON_BYTES = 256 << 20  # any JSON record of a run (a checkpoint's state lists its consumed shards)


class UnreadableObject(ValueError):
    """A store object that is refused before it is read: not a regular file, or over a size limit."""


def _check_size(rel: str, size: int, limit: int | None) -> None:
    if limit is not None and size > limit:
        raise UnreadableObject(f"{rel} is {size} bytes (at most {limit})")


def _temp_name(dst: str) -> str:
    """A temporary name beside `dst` (same folder: the rename is atomic), '.{name}.tmp-{32 hex}':
    hidden, so never listed, and saying what it was for."""
    folder, name = os.path.split(dst)
    return f"{folder}/.{name[:100]}.tmp-{uuid.uuid4().hex}"


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class RootLost(RuntimeError):
    """This process no longer owns the run root (taken over, or its history wiped): the message says which."""


class Store:
    """A run root. All paths given to methods are relative to the root.

    A process whose run lost the root is fenced (`Store.fence`): from then on every operation of
    every Store on that root raises RootLost, so a run that was taken over cannot write into the
    new owner's data.
    """

    _fenced: dict[str, str] = {}  # root URI -> why this process may no longer touch it

    def __init__(self, uri: str, retry_s: float | None = None):
        """`retry_s`: how long a call retries transient errors (default: the process's, retry.py)."""
        self.uri = normalize_uri(uri)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **storage_options(self.uri))
        self.local = self.uri.startswith("file://")
        self.retry = POLICY if retry_s is None else RetryPolicy(retry_s)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    @classmethod
    def of(cls, run: str | Store) -> Store:
        """`run` as a Store: itself when it is one, else the Store of the URI it names."""
        return run if isinstance(run, Store) else cls(run)

    @classmethod
    def fence(cls, uri: str, reason: str | None) -> None:
        """Fence this process out of the root `uri` with `reason` (None lifts the fence)."""
        if reason is None:
            cls._fenced.pop(normalize_uri(uri), None)
        else:
            cls._fenced[normalize_uri(uri)] = reason

    def path(self, rel: str = "") -> str:
        """The full path of `rel`; BadName (layout.inside) when '..' would take it outside the root."""
        if self._fenced and self.uri in self._fenced:
            raise RootLost(self._fenced[self.uri])
        return inside(self.root, rel)

    def url(self, rel: str = "") -> str:
        return f"{self.uri}/{rel}" if rel else self.uri

    def local_path(self, rel: str = "") -> Path:
        if not self.local:
            raise ValueError(f"{self.uri} is not a local store")
        return Path(self.path(rel))

    # -- objects -------------------------------------------------------------------------
    @retried
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write an object whole: readers see the old object, or the new one, never a part."""
        full = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            tmp = _temp_name(full)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, full)
            except BaseException:  # ENOSPC, EIO, interrupted: no temporary file stays behind
                _unlink_quietly(tmp)
                raise
        else:
            self.fs.pipe_file(full, data)

    @retried
    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """The object whole. Refused with UnreadableObject, before its bytes are read: a local entry that is not
        a regular file (a FIFO would block, a link to /dev/zero never ends) and, with `limit`, an object of more
        than `limit` bytes."""
        full = self.path(rel)
        if self.local:
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise UnreadableObject(f"{rel} is not a regular file")
                _check_size(rel, st.st_size, limit)
                return f.read() if limit is None else f.read(limit + 1)
        if limit is None:
            return self.fs.cat_file(full)
        data = self.fs.cat_file(full, start=0, end=limit + 1)  # one ranged GET: never more than limit + 1 bytes
        if len(data) > limit:
            raise UnreadableObject(f"{rel} is more than {limit} bytes")
        return data

    @retried
    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """The object and a version token for `write_if`; None when it does not exist."""
        full = self.path(rel)
        try:
            if self.local:
                with open(full, "rb") as f:
                    return f.read(), _file_token(os.fstat(f.fileno()))
            token = str(self.fs.info(full)["ETag"])  # before reading: a newer body only fails the write
            return self.fs.cat_file(full), token
        except FileNotFoundError:
            return None

    @retried
    def write_if(self, rel: str, data: bytes, token: str | None) -> bool:
        """Write `rel` only if it is still the version `token` (None: only if it does not exist); False when
        another writer got there first. Local: under an O_EXCL lock file, then rename; S3: a conditional PUT."""
        full = self.path(rel)
        if not self.local:
            kwargs = {"mode": "create"} if token is None else {"IfMatch": token}
            try:
                self.fs.pipe_file(full, data, **kwargs)
            except (FileExistsError, FileNotFoundError):
                return False
            except OSError as exc:  # 412 Precondition Failed (If-Match)
                if "precondition" in str(exc).lower().replace("-", ""):
                    return False
                raise
            return True
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with _lock_file(f"{os.path.dirname(full)}/.{os.path.basename(full)}.lock"):
            try:
                current: str | None = _file_token(os.stat(full))
            except FileNotFoundError:
                current = None
            if current != token:
                return False
            self.write_bytes(rel, data)
        return True

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def read_text(self, rel: str, limit: int | None = None) -> str:
        return self.read_bytes(rel, limit).decode()

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str, limit: int = MAX_JSON_BYTES) -> Any:
        """The JSON object `rel` holds; UnreadableObject over `limit` bytes (refused unread),
        ValueError when it is not JSON or nests too deeply for the parser (not a RecursionError)."""
        data = self.read_bytes(rel, limit)
        try:
            return json.loads(data)
        except RecursionError:
            raise ValueError(f"{rel}: JSON nested too deeply") from None

    @retried
    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(self.path(rel))
        return self.fs.exists(self.path(rel))

    @retried
    def delete(self, rel: str, recursive: bool = False) -> None:
        if self.exists(rel):
            self.fs.rm(self.path(rel), recursive=recursive)

    @retried
    def move(self, src: str, dst: str) -> None:
        if self.local:
            os.makedirs(os.path.dirname(self.path(dst)), exist_ok=True)
            os.replace(self.path(src), self.path(dst))
        else:
            self.fs.mv(self.path(src), self.path(dst))

    @retried
    def find(self, prefix: str, suffix: str = "") -> list[str]:
        """All object paths under `prefix` (relative to the root), sorted; hidden temp files skipped."""
        base = self.path(prefix)
        if self.local:
            if not os.path.isdir(base):
                return []
            out: list[str] = []
            _walk_local(base, os.path.relpath(base, self.root), suffix, out)  # O(files), no relpath per file
            return sorted(out)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(p[n:] for p in found if p.endswith(suffix) and not p.rsplit("/", 1)[-1].startswith("."))

    @retried
    def find_after(self, folder: str, after: str | None, suffix: str = "") -> list[str]:
        """The files directly in `folder` whose path sorts after `after` (a path in it; None: all),
        sorted, hidden files skipped. On S3 one ListObjectsV2 from `StartAfter`, so the cost is
        the files after it, not the folder's; other stores list the folder and filter."""
        if not self.local and getattr(self.fs, "protocol", None) in ("s3", ("s3", "s3a"), ("s3a", "s3")):
            return self._s3_after(folder, after, suffix)
        names = self.listdir(folder)
        out = [f"{folder}/{n}" for n in names if n.endswith(suffix)]
        return [p for p in out if after is None or p > after]

    def _s3_after(self, folder: str, after: str | None, suffix: str) -> list[str]:
        bucket, _, key = self.path(folder).partition("/")
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{key}/", "Delimiter": "/"}
        if after is not None:
            kwargs["StartAfter"] = self.path(after).partition("/")[2]
        key_root = self.root.partition("/")[2]
        n = len(key_root) + 1 if key_root else 0
        out: list[str] = []
        while True:
            page = self.fs.call_s3("list_objects_v2", **kwargs)
            for obj in page.get("Contents", []):
                rel = obj["Key"][n:]
                if rel.endswith(suffix) and not rel.rsplit("/", 1)[-1].startswith("."):
                    out.append(rel)
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    @retried
    def has_any(self, prefix: str = "") -> bool:
        """Whether `prefix` holds anything at all: any file or folder, hidden ones included (a
        root with only dot-files, or only empty folders, is not empty); also True for a file."""
        base = self.path(prefix)
        if self.local:
            if not os.path.isdir(base):
                return os.path.lexists(base)
            with os.scandir(base) as entries:
                return next(entries, None) is not None
        try:
            return bool(self.fs.ls(base, detail=False)) or self.fs.isfile(base)
        except FileNotFoundError:
            return False

    def clean_temp(self, *prefixes: str, older_than_s: float = TEMP_STALE_S) -> int:
        """Remove the store's own temporary and lock files under `prefixes` ("" = the whole root) not modified
        for `older_than_s`: what a writer killed mid-write left (a live writer's are younger). Only local stores
        have them (an object store write is one PUT). Returns how many were removed."""
        if not self.local:
            return 0
        now, removed = time.time(), 0
        for prefix in prefixes:
            for folder, _, files in os.walk(self.path(prefix)):  # symlinked folders are not entered
                for name in files:
                    if _TEMP_NAME.fullmatch(name):
                        path = os.path.join(folder, name)
                        try:
                            if now - os.lstat(path).st_mtime > older_than_s:
                                os.unlink(path)
                                removed += 1
                        except FileNotFoundError:
                            continue
        return removed

    @retried
    def listdir(self, prefix: str) -> list[str]:
        """Names directly under `prefix` (files and folders), sorted."""
        base = self.path(prefix)
        if self.local:
            return sorted(n for n in os.listdir(base) if not n.startswith(".")) if os.path.isdir(base) else []
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        except FileNotFoundError:
            return []

    # -- folders -------------------------------------------------------------------------------
    @retried
    def put_dir(self, local_dir: str | Path, rel: str) -> None:
        """Upload every file under `local_dir` to `rel` in one batched fsspec put (concurrent on S3)."""
        base = Path(local_dir)
        names = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
        dsts = [self.path(_join(rel, n)) for n in names]
        if self.local:
            _makedirs(dsts)
        op = _landed(self.fs.put) if self.local else self.fs.put
        _markers_last(op, [str(base / n) for n in names], dsts, names)

    @retried
    def get_dir(self, rel: str, local_dir: str | Path) -> None:
        """Download every object under `rel` ("" = the whole root) into `local_dir` in one batched get."""
        found = self.find(rel)
        names = [p[len(rel) + 1 :] if rel else p for p in found]
        dsts = [str(Path(local_dir, n)) for n in names]
        _makedirs(dsts)
        _markers_last(_landed(self.fs.get), [self.path(p) for p in found], dsts, names)

    @retried
    def copy_dir(self, src: str, dst: str, source: Store | None = None) -> None:
        """Copy the folder `src` of `source` (default: this store) to `dst` here without passing
        the bytes through this process: fsspec's batched copy, server-side on S3. Between stores
        on different filesystems it goes through a local temp folder."""
        source = source or self
        if type(source.fs) is not type(self.fs):
            with tempfile.TemporaryDirectory() as tmp:
                source.get_dir(src, tmp)
                self.put_dir(tmp, dst)
            return
        found = source.find(src)
        names = [p[len(src) + 1 :] if src else p for p in found]
        dsts = [self.path(_join(dst, n)) for n in names]
        if self.local:
            _makedirs(dsts)
        op = _landed(self.fs.copy) if self.local else self.fs.copy
        _markers_last(op, [source.path(p) for p in found], dsts, names)

    # -- markers and status ----------------------------------------------------------------
    def done(self) -> bool:
        return self.exists(LAYOUT.done)

    def latest_version(self) -> int | None:
        try:
            return int(self.read_text(LAYOUT.latest).strip())
        except (FileNotFoundError, ValueError):
            return None

    def discarded_groups(self) -> int:
        """Groups the trainer discarded untrained (they give their admission back); 0 if none yet."""
        try:
            groups = json.loads(self.read_bytes(LAYOUT.discarded_groups, SMALL_JSON_BYTES))["groups"]
        except (FileNotFoundError, KeyError, TypeError, ValueError, RecursionError):  # ValueError: JSON, UTF-8, size
            return 0
        return groups if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 else 0

    def heartbeat(self, role: str, worker_id: str, **counters: Any) -> None:
        self.write_json(
            LAYOUT.status(role, worker_id),
            {"role": role, "id": worker_id, "time": time.time(), "store_retries": self.retry.retries, **counters},
        )

    def statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name in self.find(LAYOUT.status_dir, ".json"):
            try:
                out[name.rsplit("/", 1)[-1][:-5]] = json.loads(self.read_bytes(name, SMALL_JSON_BYTES))
            except (ValueError, RecursionError, FileNotFoundError):  # not JSON, not UTF-8, too big, too deep
                continue
        return out


def _file_token(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


@contextlib.contextmanager
def _lock_file(lock: str, wait_s: float = 10.0, stale_s: float = 30.0) -> Iterator[None]:
    """Hold `lock` (created with O_EXCL) for a few file operations; a lock older than `stale_s`
    was left by a dead process and is broken."""
    deadline = time.time() + wait_s
    while True:
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            try:
                if time.time() - os.stat(lock).st_mtime > stale_s:
                    os.unlink(lock)
                    continue
            except FileNotFoundError:
                continue
            if time.time() > deadline:
                raise TimeoutError(f"{lock} held for {wait_s:.0f}s") from None
            time.sleep(0.005)
    try:
        yield
    finally:
        os.unlink(lock)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _makedirs(paths: list[str]) -> None:
    for parent in {os.path.dirname(p) for p in paths}:
        os.makedirs(parent, exist_ok=True)


def _landed(op: Callable[[list[str], list[str]], Any]) -> Callable[[list[str], list[str]], None]:
    """`op` (a batched transfer onto the local disk) made to write temporary names beside the
    destinations, renamed when all are whole; on any error the temporary files are removed (the
    destinations renamed before it stay: whole files, and their folder's marker is not written)."""

    def run(srcs: list[str], dsts: list[str]) -> None:
        tmps = [_temp_name(d) for d in dsts]
        try:
            op(srcs, tmps)
            for tmp, dst in zip(tmps, dsts):
                os.replace(tmp, dst)
        except BaseException:
            for tmp in tmps:
                _unlink_quietly(tmp)
            raise

    return run


def _markers_last(
    op: Callable[[list[str], list[str]], Any], srcs: list[str], dsts: list[str], names: list[str]
) -> None:
    """Run the batched fsspec transfer `op` on every file but the markers, then on the markers, so
    a folder published this way becomes visible only once whole (atomic publish)."""
    marker = [n.rsplit("/", 1)[-1] in LAYOUT.markers for n in names]
    for last in (False, True):
        idx = [i for i, m in enumerate(marker) if m is last]
        if idx:
            op([srcs[i] for i in idx], [dsts[i] for i in idx])


def _walk_local(folder: str, rel: str, suffix: str, out: list[str]) -> None:
    """Append the non-hidden files under `folder` ending in `suffix`, as paths under `rel` ("." for the root); like
    os.walk, symlinked folders are not entered and a folder that cannot be read (removed meanwhile) is skipped."""
    prefix = "" if rel == "." else f"{rel}/"
    try:
        entries = os.scandir(folder)
    except OSError:
        return
    with entries:
        for e in entries:
            if e.is_dir():
                if not e.is_symlink():
                    _walk_local(e.path, prefix + e.name, suffix, out)
            elif not e.name.startswith(".") and e.name.endswith(suffix):
                out.append(prefix + e.name)
