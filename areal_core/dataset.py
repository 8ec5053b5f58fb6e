"""A run's samples as a dataset: `pyarrow.dataset` over its Arrow IPC shards, joined with the
trainer's audit records, for pyarrow, DuckDB and pandas (docs/dataset.md).

    from areal_core.dataset import open_run
    run = open_run("s3://bucket/runs/job")                    # a pyarrow.dataset.Dataset
    duckdb.sql("SELECT step, count(*) FROM run WHERE status = 'trained' GROUP BY step")

One row a sample of the layer (`graded` by default; `ungraded`, or a re-graded layer by name),
trained or not. Shard columns (protocol.SCHEMA) plus, per sample:
  root                      the run root holding the shard: the run's own, or for a fork an
                            ancestor's (the parent shards it references, and its pending samples)
  shard_seq, row            the shard's sequence number under its worker (null for a shard whose
                            name is not one a writer gives, e.g. a copy 'copy-of-1.arrow') and
                            the row in it
  policy_tokens             Σ loss_mask
  min_version, max_version  over the policy tokens (−1 when none)
  reward_source, reward_reason   from reward_info: who graded it, and why when it says
                            (`reason`, else `error`, else the code tests' `failures`, else a label;
                            null when reward_info is not a JSON object)
  status                    trained | dropped (older than v − η) | abandoned (weights of an
                            abandoned version) | untrained (still buffered, or never read) |
                            duplicate (another row has the same identity, worker_id/sample_id:
                            a copied shard; the trainer reads an identity once, and so the audit
                            joins one row per identity, the first in the trainer's order)
  step, step_index          the step whose audit record lists the sample, and its position there
  trainer_version           the version that step trained from (v)
  staleness                 v − min_version: the oldest token's staleness at training / at the drop
The audit (trainer/trained/step-N.json) names samples by worker and sample id; records of an
older trainer without `*_workers` are joined on the sample id alone.
A multimodal row's `image_ids` (null for text rows and for shards written before the column)
name its prompt's images; `load_images(run, row["image_ids"])` reads them back (docs/vlm.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from areal_core.forks import image_roots, read_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import SCHEMA, SCHEMA_VERSION
from areal_core.store import Store
from areal_core.vlm.images import read_from

log = logging.getLogger("areal.dataset")

TOKEN_COLUMNS = ("input_ids", "behav_logprobs", "token_rewards", "routes")  # the wide ones: only with tokens=True
BASE_COLUMNS = [n for n in SCHEMA.names if n not in TOKEN_COLUMNS]
REL = "__rel"  # internal: a row's shard path relative to its root
STATUSES = ("trained", "dropped", "abandoned", "untrained", "duplicate")


class DatasetError(ValueError):
    """A run or layer that cannot be opened as a dataset; the message says why."""


def shard_files(run: str | Store, layer: str = "graded") -> list[str]:
    """The layer's shard paths, relative to the run root, sorted (worker, then sequence)."""
    store = Store.of(run)
    try:
        folder = LAYOUT.layer_dir(layer)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    if layer not in LAYOUT.base_layers and not store.exists(LAYOUT.committed(folder)):
        raise DatasetError(f"{store.url(folder)}: no committed layer {layer!r} (missing or unfinished)")
    return store.find(folder, ".arrow")


def shard_dataset(run: str | Store, layer: str = "graded") -> ds.FileSystemDataset:
    """The layer's shards as one lazy pyarrow dataset with the protocol schema, read through the
    store's own fsspec filesystem (s3fs on S3). Nothing is read until it is scanned."""
    store = Store.of(run)
    files = [store.path(p) for p in shard_files(store, layer)]
    return ds.dataset(files, schema=SCHEMA, format="ipc", filesystem=store.fs)


def open_run(run: str | Store, layer: str = "graded", tokens: bool = False) -> ds.Dataset:
    """The layer's samples joined with the trainer's audit (module docstring), as a dataset.
    `tokens`: also the wide per-token columns (input_ids, behav_logprobs, token_rewards)."""
    return ds.dataset(samples_table(run, layer, tokens))


def samples_table(run: str | Store, layer: str = "graded", tokens: bool = False) -> pa.Table:
    """`open_run` as one pyarrow Table."""
    store = Store.of(run)
    columns = SCHEMA.names if tokens else BASE_COLUMNS
    table = _with_token_stats(_rows(store, layer, columns))
    table = _with_reward_reason(table)
    return _mark_duplicates(_join_audit(table, read_audit(store))).drop_columns([REL])


def _rows(store: Store, layer: str, columns: list[str]) -> pa.Table:
    """The layer's rows with root, shard_seq, row (and REL). A fork's graded layer also holds the
    parent's rows it may train on (module docstring), from the parent's own rows (recursively)."""
    table = _with_shard_position(_scan(store, layer, columns), store)
    if layer != "graded" or not store.exists(LAYOUT.fork_parent):
        return table
    ref = read_fork(store)
    inherited = _rows(Store(ref.parent), layer, columns)
    where = pc.binary_join_element_wise(inherited["root"], inherited[REL], "|")
    referenced = pa.array([f"{root}|{rel}" for rel, root in ref.shards.items()], pa.string())
    listed = _np(pc.is_in(where, value_set=referenced)) & _on_lineage(inherited, ref.version, ref.abandoned)
    keys = read_audit(store)["key"]
    identity = pc.binary_join_element_wise(inherited["worker_id"], inherited["sample_id"], "/")
    named = _np(pc.is_in(identity, value_set=keys)) | _np(pc.is_in(inherited["sample_id"], value_set=keys))
    # the parent's later samples may share an identity with the fork's own (the same group index)
    own = _np(pc.is_in(identity, value_set=pc.binary_join_element_wise(table["worker_id"], table["sample_id"], "/")))
    return pa.concat_tables([table, inherited.filter(pa.array(listed | (named & ~own)))])


def _np(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)


def _on_lineage(table: pa.Table, version: int, abandoned: list[list[int]]) -> np.ndarray:
    """forks.on_lineage over a table, shard by shard: False for the rows of a group one of whose
    policy tokens has a version above `version` or inside an abandoned [lo, hi]."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, bool)
    parents = pc.list_parent_indices(table["loss_mask"].combine_chunks()).to_numpy()
    on = pc.list_flatten(table["loss_mask"].combine_chunks()).to_numpy(zero_copy_only=False) > 0
    v = pc.list_flatten(table["versions"].combine_chunks()).to_numpy(zero_copy_only=False)
    bad = on & (v > version)
    for lo, hi in abandoned:
        bad |= on & (v >= lo) & (v <= hi)
    bad_row = np.bincount(parents[bad], minlength=n) > 0
    group = pc.binary_join_element_wise(table["root"], table[REL], table["group_id"], "|")
    bad_groups = group.filter(pa.array(bad_row))
    return ~_np(
        pc.is_in(group, value_set=bad_groups.combine_chunks() if bad_groups.num_chunks else pa.array([], pa.string()))
    )


def _scan(store: Store, layer: str, columns: list[str]) -> pa.Table:
    """Every shard's rows and its path (`__filename`). A shard that does not parse or has another
    schema version is skipped with a warning: it is the trainer's to quarantine, not ours."""
    dataset = shard_dataset(store, layer)
    cols = [*columns, "__filename"]
    try:
        return _checked(dataset.to_table(columns=cols), dataset)
    except (pa.ArrowInvalid, OSError, _VersionError):
        pass
    parts = []
    for fragment in dataset.get_fragments():
        try:
            if _version(fragment.physical_schema) != SCHEMA_VERSION:
                raise _VersionError(_version(fragment.physical_schema))
            parts.append(
                fragment.to_table(columns=columns, schema=SCHEMA).append_column(
                    "__filename", pa.array([fragment.path] * fragment.count_rows(), pa.string())
                )
            )
        except (pa.ArrowInvalid, OSError, _VersionError) as exc:
            log.warning("skipped shard %s: %s", fragment.path, exc)
    if not parts:
        return dataset.schema.empty_table().select(columns).append_column("__filename", pa.array([], pa.string()))
    return pa.concat_tables(parts)


class _VersionError(ValueError):
    pass


def _version(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"areal.schema_version", b"").decode()


def _checked(table: pa.Table, dataset: ds.FileSystemDataset) -> pa.Table:
    """The fast path reads every file in one scan; it stands only if every file has our version."""
    for fragment in dataset.get_fragments():
        if _version(fragment.physical_schema) != SCHEMA_VERSION:
            raise _VersionError(fragment.path)
    return table


def _with_shard_position(table: pa.Table, store: Store) -> pa.Table:
    """root (the run root holding the shard), shard_seq from the file name, and row = the sample's
    position within its shard (the scan keeps each file's rows in order); REL: the shard's path."""
    files = pc.dictionary_encode(table["__filename"]).combine_chunks()
    paths = files.dictionary.to_pylist()
    seqs = pa.array([LAYOUT.shard_seq(p) for p in paths], pa.int32())  # null: not a writer's name
    rels = pa.array([p[len(store.root) + 1 :] for p in paths], pa.string())
    codes = files.indices.to_numpy()
    order = np.argsort(codes, kind="stable")  # each file's rows together, in scan order
    sorted_codes = codes[order]
    starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]]) if len(codes) else np.zeros(0, int)
    row = np.empty(len(codes), np.int32)
    row[order] = np.arange(len(codes)) - np.repeat(starts, np.diff(np.r_[starts, len(codes)]))
    seq = seqs.take(pa.array(codes)) if len(codes) else pa.array([], pa.int32())
    table = table.drop_columns(["__filename"])
    return (
        table.append_column("root", pa.array([store.uri] * len(codes), pa.string()))
        .append_column("shard_seq", seq)
        .append_column("row", pa.array(row.astype(np.int32)))
        .append_column(REL, rels.take(pa.array(codes)) if len(codes) else pa.array([], pa.string()))
    )


def _with_token_stats(table: pa.Table) -> pa.Table:
    """policy_tokens, min_version, max_version over the tokens with loss_mask = 1."""
    n = table.num_rows
    mask = table["loss_mask"].combine_chunks()
    versions = table["versions"].combine_chunks()
    parents = pc.list_parent_indices(mask).to_numpy()
    on = pc.list_flatten(mask).to_numpy(zero_copy_only=False) > 0
    flat_v = pc.list_flatten(versions).to_numpy(zero_copy_only=False)
    counts = np.bincount(parents[on], minlength=n).astype(np.int32)
    lo = np.full(n, np.iinfo(np.int32).max, np.int64)
    hi = np.full(n, -1, np.int64)
    np.minimum.at(lo, parents[on], flat_v[on])
    np.maximum.at(hi, parents[on], flat_v[on])
    lo[counts == 0] = -1
    return (
        table.append_column("policy_tokens", pa.array(counts))
        .append_column("min_version", pa.array(lo.astype(np.int32)))
        .append_column("max_version", pa.array(hi.astype(np.int32)))
    )


def reward_reason(info: dict[str, Any]) -> str | None:
    """Why a reward is what it is, when the grader said: `reason`, else `error`, else the code
    tests' failures, else the human label that set it."""
    for key in ("reason", "error"):
        if info.get(key):
            return str(info[key])
    if info.get("failures"):
        failures = info["failures"]
        return "; ".join(map(str, failures)) if isinstance(failures, list) else str(failures)
    if isinstance(info.get("label"), dict):
        return f"label ({info['label'].get('key', 'sample_id')})"
    return None


def _info(text: str | None) -> dict[str, Any]:
    """A row's reward_info as a mapping: the protocol allows any JSON (a list, a number), and a
    reader must not break on it; {} for anything but a JSON object."""
    try:
        info = json.loads(text) if text else {}
    except (ValueError, TypeError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def _with_reward_reason(table: pa.Table) -> pa.Table:
    infos = [_info(s) for s in table["reward_info"].to_pylist()]
    source = pa.array([None if i.get("reward_source") is None else str(i["reward_source"]) for i in infos], pa.string())
    reason = pa.array([reward_reason(i) for i in infos], pa.string())
    return table.append_column("reward_source", source).append_column("reward_reason", reason)


def _mark_duplicates(table: pa.Table) -> pa.Table:
    """status 'duplicate' (and no step, version or staleness) for every row whose identity
    (worker_id/sample_id) an earlier row has. Earlier: a shard named as its writer names it
    ({seq:08d}.arrow under a folder named after the sample's worker) before any other name,
    then the order the trainer reads shards in (sorted paths, the run's own before a parent's)."""
    n = table.num_rows
    if n == 0:
        return table
    identity = np.asarray(pc.binary_join_element_wise(table["worker_id"], table["sample_id"], "/").to_pylist(), object)
    rels = table[REL].to_pylist()
    workers = table["worker_id"].to_pylist()
    odd = np.array([LAYOUT.shard_seq(r) is None or r.rsplit("/", 2)[-2:-1] != [w] for r, w in zip(rels, workers)], bool)
    order = np.lexsort((np.arange(n), odd))  # writer-named shards first, then table order
    _, first = np.unique(identity[order], return_index=True)
    dup = np.ones(n, bool)
    dup[order[first]] = False
    if not dup.any():
        return table
    mask = pa.array(dup)
    for name in ("step", "step_index", "trainer_version", "staleness"):
        col = table[name]
        table = table.set_column(
            table.schema.get_field_index(name), name, pc.if_else(mask, pa.scalar(None, col.type), col)
        )
    status = pc.if_else(mask, pa.scalar("duplicate"), table["status"])
    return table.set_column(table.schema.get_field_index("status"), "status", status)


AUDIT_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("status", pa.string()),
        ("step", pa.int32()),
        ("step_index", pa.int32()),
        ("trainer_version", pa.int32()),
        ("audit_min_version", pa.int32()),
    ]
)


def read_audit(run: str | Store) -> pa.Table:
    """Every audit record as one row a listed sample: key (worker/sample id, or the sample id for
    records without workers), status, step, position in the step, trainer version, min version.
    Trained entries come first, so a key listed twice joins as trained."""
    store = Store.of(run)
    rows: dict[str, list[list[Any]]] = {s: [] for s in STATUSES}
    paths = [store.path(p) for p in store.find(LAYOUT.trained_dir, ".json")]
    bodies = store.fs.cat(paths) if paths else {}  # one batched (concurrent on S3) read
    for path in paths:
        rec = json.loads(bodies[path])
        for status, entries in (("trained", "samples"), ("dropped", "dropped"), ("abandoned", "abandoned")):
            listed = rec.get(entries) or []
            workers = rec.get(f"{'sample' if entries == 'samples' else entries}_workers")
            for i, (sample_id, min_version) in enumerate(listed):
                key = f"{workers[i]}/{sample_id}" if workers else str(sample_id)
                rows[status].append([key, status, rec["step"], i, rec["trainer_version"], min_version])
    ordered = [r for s in STATUSES for r in rows[s]]
    return pa.Table.from_arrays(
        [pa.array([r[k] for r in ordered], f.type) for k, f in enumerate(AUDIT_SCHEMA)], schema=AUDIT_SCHEMA
    )


def _join_audit(table: pa.Table, audit: pa.Table) -> pa.Table:
    """Left join on the sample identity (the sample id alone for records without workers)."""
    full = pc.binary_join_element_wise(table["worker_id"], table["sample_id"], "/")
    idx = pc.index_in(full, value_set=audit["key"])
    bare = pc.index_in(table["sample_id"], value_set=audit["key"])  # records of an older trainer
    idx = pc.coalesce(idx, bare)
    for name in ("status", "step", "step_index", "trainer_version"):
        table = table.append_column(name, audit[name].take(idx))
    table = table.set_column(
        table.schema.get_field_index("status"), "status", pc.coalesce(table["status"], pa.scalar("untrained"))
    )
    staleness = pc.subtract(table["trainer_version"], audit["audit_min_version"].take(idx))
    return table.append_column("staleness", staleness)


def load_images(run: str | Store, image_ids: list[str] | None) -> list[Any]:
    """The PIL images a row's `image_ids` name, from the run or the roots it derives from
    (forks.image_roots); vlm.images.ImageError when one is missing, altered or undecodable."""
    roots = image_roots(run)
    return [read_from(roots, sha) for sha in image_ids or []]
