"""Rows of a split from the tables users have: JSONL, JSON (an array, or one object per line),
Parquet, CSV and Arrow (IPC file or stream, Feather), at any local path or fsspec URI.

`split_files(root, split)` finds a split, trying in order:

    root itself, when it is a file (the same file for every split)
    <root>/<split>.<ext>                              train.jsonl, test.parquet, ...
    <root>/<split>-NNNNN-of-NNNNN.<ext>               a hub config folder given as the root
    <root>/data/<split>-*.<ext>                       the hub's default layout
    <root>/<split>/data-*.<ext>                       `datasets.save_to_disk` (data-00000-of-00001.arrow)
    <root>/<config>/<split>-*.<ext>                   the hub layout with configs (openai/gsm8k: main/, socratic/)

Any of these may be compressed (`train.jsonl.gz`, `.bz2`, `.xz`, `.zst`).

The last refuses two configs at once and names them (point task.path at one). A missing split
names everything it looked for; a bad row names the file and the row.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import re
from typing import Any

import fsspec

EXTENSIONS = ("jsonl", "json", "parquet", "csv", "arrow", "feather")
COMPRESSIONS = {"gz": "gzip", "bz2": "bz2", "xz": "xz", "zst": "zstd"}  # train.jsonl.gz and the like


def table_format(name: str) -> str | None:
    """The table format of a file name (`train.jsonl.gz` -> jsonl), or None."""
    parts = name.lower().rsplit("/", 1)[-1].split(".")
    if len(parts) > 2 and parts[-1] in COMPRESSIONS:
        parts = parts[:-1]
    return parts[-1] if len(parts) > 1 and parts[-1] in EXTENSIONS else None


MAX_TABLE_BYTES = 2 * 1024**3  # one split's files together
MAX_TABLE_ROWS = 10_000_000  # rows of one table file (a column of nulls costs no bytes per row)


class TaskDataError(ValueError):
    """A missing or malformed task-data file (a table a task reads prompts from), named in the message.
    Not areal_core.dataset.DatasetError, which is about reading a run's samples."""


class MissingSplit(TaskDataError):
    """The data has no table for a split (a read or format error is a TaskDataError, never this)."""


def _fs(uri: str) -> tuple[Any, str]:
    from areal_core.store import storage_options

    fs, path = fsspec.core.url_to_fs(uri, **storage_options(uri))
    return fs, path


def _url(fs: Any, path: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, (list, tuple)) else fs.protocol
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def split_files(root: str, split: str) -> list[str]:
    """The files of `split` under `root` (see the module docstring), as URIs, sorted. Hidden
    entries (`.ipynb_checkpoints/`, `.cache/`) are never data; two tables named for the split
    (`train.json` and `train.jsonl`), or one split in two configs, are refused by name."""
    fs, base = _fs(root)
    base = base.rstrip("/")
    if fs.isfile(base):
        return [_url(fs, base)]
    if not fs.isdir(base):
        raise TaskDataError(f"dataset file or folder '{root}' does not exist")
    escaped = glob.escape(base)
    named = sorted(p for p in fs.glob(f"{escaped}/{glob.escape(split)}.*") if table_format(p))
    if len(named) > 1:
        shown = ", ".join(p.rsplit("/", 1)[-1] for p in named)
        raise TaskDataError(f"dataset '{root}' has {len(named)} tables for the {split} split ({shown}): keep one")
    if named:
        return [_url(fs, named[0])]
    tried = [f"{split}.<ext>[.gz]"]
    shard = re.compile(rf"(^|/)({re.escape(split)}-\d+-of-\d+[^/]*|data-\d+-of-\d+[^/]*)$")
    for pattern in (f"{split}-*", f"data/{split}-*", f"{split}/data-*", f"*/{split}-*"):
        tried.append(pattern + "-of-*")
        found = sorted(
            p
            for p in fs.glob(f"{escaped}/{pattern}")
            if table_format(p) and shard.search(p) and not _hidden(p[len(base) + 1 :])
        )
        if not found:
            continue
        configs = sorted({p[len(base) + 1 :].split("/")[0] for p in found}) if pattern.startswith("*/") else []
        if len(configs) > 1:
            raise TaskDataError(
                f"dataset '{root}' holds the {split} split of {len(configs)} configs {configs}: "
                f"set task.path to one of them ('{root.rstrip('/')}/{configs[0]}')"
            )
        return [_url(fs, p) for p in found]
    raise MissingSplit(f"dataset '{root}' has no {split} split: looked for {', '.join(tried)} ({'/'.join(EXTENSIONS)})")


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def read_rows(uri: str) -> list[dict[str, Any]]:
    """Every row of one table file, as dicts (the format from the file's extension)."""
    ext = table_format(uri)
    if ext is None:
        raise TaskDataError(
            f"dataset file '{uri}': not a table format this reads ({', '.join(EXTENSIONS)}, compressed or not)"
        )
    fs, path = _fs(uri)
    compression = COMPRESSIONS.get(uri.rsplit(".", 1)[-1].lower())
    try:
        if fs.size(path) > MAX_TABLE_BYTES:
            raise TaskDataError(f"dataset file '{uri}' is larger than {MAX_TABLE_BYTES} bytes")
        with fs.open(path, "rb", compression=compression) as f:
            data = f.read(MAX_TABLE_BYTES + 1)
    except FileNotFoundError:
        raise TaskDataError(f"dataset file '{uri}' does not exist") from None
    except (OSError, EOFError, ValueError) as exc:  # a damaged compressed file
        raise TaskDataError(f"dataset file '{uri}': cannot decompress it ({str(exc)[:200]})") from None
    if len(data) > MAX_TABLE_BYTES:
        raise TaskDataError(f"dataset file '{uri}' is larger than {MAX_TABLE_BYTES} bytes uncompressed")
    if ext in ("jsonl", "json", "csv"):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise TaskDataError(f"dataset file '{uri}': not UTF-8 text (byte {exc.start})") from None
        if ext == "csv":  # every cell as its text: no type inference turns '007' into 7.0 or '' into null
            return [dict(row) for row in csv.DictReader(io.StringIO(text, newline=""))]
        return _json_rows(uri, text)
    import pyarrow as pa

    try:
        table = _parquet_table(data) if ext == "parquet" else _arrow_table(data)
    except (pa.ArrowException, OSError, ValueError) as exc:  # IpcError is a ValueError
        raise TaskDataError(f"dataset file '{uri}': not a readable .{ext} table ({str(exc)[:200]})") from None
    return table.to_pylist()


def _arrow_table(data: bytes) -> Any:
    """An Arrow IPC file or stream (what `datasets.save_to_disk` writes) read by the project's
    checked reader: each batch validated, at most MAX_TABLE_ROWS rows, compressed buffers only
    while what they declare stays within MAX_TABLE_BYTES (pyarrow's own reader inflates first)."""
    from areal_core.ipc_reader import MAGIC, read_ipc_file, read_ipc_stream

    read = read_ipc_file if data[:6] == MAGIC else read_ipc_stream
    return read(data, MAX_TABLE_ROWS, max_inflated=MAX_TABLE_BYTES)


def _parquet_table(data: bytes) -> Any:
    """A Parquet file, refused before its pages are inflated when its footer declares more than
    MAX_TABLE_ROWS rows or MAX_TABLE_BYTES uncompressed (the reader allocates what pages declare)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    rows = sum(g.num_rows for g in groups)
    inflated = sum(g.column(c).total_uncompressed_size for g in groups for c in range(g.num_columns))
    if rows > MAX_TABLE_ROWS or inflated > MAX_TABLE_BYTES:
        raise ValueError(f"{rows} rows, {inflated} bytes uncompressed (at most {MAX_TABLE_ROWS}, {MAX_TABLE_BYTES})")
    return pq.read_table(io.BytesIO(data))


def _json_rows(uri: str, text: str) -> list[dict[str, Any]]:
    try:
        return _json_rows_unchecked(uri, text)
    except RecursionError:
        raise TaskDataError(f"dataset file '{uri}': JSON nested too deeply") from None


def _json_rows_unchecked(uri: str, text: str) -> list[dict[str, Any]]:
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON array of objects
        try:
            rows = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"dataset file '{uri}': not JSON ({exc.msg} at line {exc.lineno})") from None
        numbered = list(enumerate(rows, 1))
    else:
        numbered = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((i, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise TaskDataError(f"dataset file '{uri}' line {i}: not JSON ({exc.msg}){_whole(text)}") from None
    for i, row in numbered:
        if not isinstance(row, dict):
            raise TaskDataError(f"dataset file '{uri}' row {i}: a {type(row).__name__}, not an object")
    return [row for _, row in numbered]


def _whole(text: str) -> str:
    """A hint when the whole text is one JSON object (`{"data": [...]}`), not rows."""
    try:
        whole = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return ""
    if isinstance(whole, dict):
        return (
            f"; the file is one JSON object (keys {sorted(whole)[:5]}), not rows: give an array or one object per line"
        )
    return ""


def read_split(root: str, split: str) -> list[tuple[str, int, dict[str, Any]]]:
    """(file, row number from 1, row) of every row of `split` under `root`, files in order."""
    out = []
    for uri in split_files(root, split):
        out += [(uri, i, row) for i, row in enumerate(read_rows(uri), 1)]
    return out
