"""Trajectory protocol: Arrow IPC shards, one row a sample (docs/design.md, "Trajectory protocol").

A shard that fails to parse or validate is moved to `quarantine/` with the reason and
counted by the reader; it never crashes the consumer.
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from areal_core.ipc_reader import IpcError, read_ipc_file
from areal_core.layout import LAYOUT
from areal_core.routes import ROUTES_TYPE, RouteShape, decode_routes, encode_routes, routes_problem
from areal_core.store import Store, UnreadableObject

SCHEMA_VERSION = "1"

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("worker_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("prompt_len", pa.int32()),
        ("loss_mask", pa.list_(pa.int8())),
        ("behav_logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("reward", pa.float32()),
        ("token_rewards", pa.list_(pa.float32())),
        ("reward_info", pa.string()),
        ("num_turns", pa.int32()),
        ("created_at", pa.float64()),
        ("meta", pa.string()),
        ("image_ids", pa.list_(pa.string())),  # optional: the prompt's images (sha256 ids, areal_core/vlm/images.py)
        ("routes", ROUTES_TYPE),  # optional: an MoE engine's expert choices per token and layer (areal_core/routes.py)
    ],
    metadata={"areal.schema_version": SCHEMA_VERSION},
)
# Columns a shard may lack (written before they existed); read as null. The version stays "1".
OPTIONAL_COLUMNS = ("image_ids", "routes")


FLOAT32_MAX = 3.4028234663852886e38  # rewards are stored as float32: anything larger becomes inf


def finite_reward(value: float) -> bool:
    """True when `value` is a real number that float32 holds finitely: |value| <= FLOAT32_MAX
    (1e39 passes math.isfinite but is stored as inf)."""
    if not isinstance(value, numbers.Real):
        return False
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_reward(value: Any, low: float, high: float) -> float:
    """`value` as a float when it is a finite number with low <= value <= high; else ValueError
    saying why. Every reward that enters from outside (a proxy client, an agent's return value)
    passes here before it can reach a shard."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"reward must be a number, got {type(value).__name__}")
    if not finite_reward(value):
        raise ValueError(f"reward must be finite, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"reward {value:g} is outside the allowed range [{low:g}, {high:g}]")
    return float(value)


class ShardError(ValueError):
    """A shard that cannot be parsed or breaks the schema; the message says why."""


@dataclass
class Sample:
    """One trajectory: prompt then response tokens, with per-token behaviour data."""

    sample_id: str
    group_id: str
    prompt_id: str
    worker_id: str
    input_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"
    reward: float | None = None
    token_rewards: list[float] | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 1
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)
    image_ids: list[str] | None = None  # the prompt's images, by sha256 (Layout.image); rows never hold pixels
    # an MoE engine's expert ids, [len(input_ids), moe_layers, k] uint8/uint16 (areal_core/routes.py); None: none
    routes: Any = field(default=None, compare=False, repr=False)

    def response_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]

    def identity(self) -> str:
        """The sample's content identity, whatever shard or path it was read from: the worker that
        generated it and its sample id (unique per worker within a run). Consumers deduplicate
        on it, so a shard copied under another name is not used twice."""
        return f"{self.worker_id}/{self.sample_id}"

    def min_version(self) -> int:
        """Oldest policy version among the tokens the policy produced (-1 if none)."""
        produced = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(produced) if produced else -1


def _check(sample: Sample) -> None:
    n = len(sample.input_ids)
    if not (len(sample.loss_mask) == len(sample.behav_logprobs) == len(sample.versions) == n):
        raise ShardError(f"sample {sample.sample_id}: per-token columns differ in length from input_ids ({n})")
    if not 0 <= sample.prompt_len <= n:
        raise ShardError(f"sample {sample.sample_id}: prompt_len {sample.prompt_len} outside 0..{n}")
    if sample.routes is not None and len(sample.routes) != n:
        raise ShardError(f"sample {sample.sample_id}: routes cover {len(sample.routes)} positions, input_ids {n}")
    if sample.token_rewards is not None and len(sample.token_rewards) != n:
        raise ShardError(f"sample {sample.sample_id}: token_rewards length differs from input_ids")
    if sample.reward is not None and not finite_reward(sample.reward):
        raise ShardError(f"sample {sample.sample_id}: reward {sample.reward!r} is not finite in float32")
    if not all(map(math.isfinite, sample.behav_logprobs)):
        raise ShardError(f"sample {sample.sample_id}: behav_logprobs hold a NaN or infinite value")
    if sample.token_rewards is not None and not all(map(finite_reward, sample.token_rewards)):
        raise ShardError(f"sample {sample.sample_id}: token_rewards hold a value that is not finite in float32")
    for image in sample.image_ids or []:
        try:
            LAYOUT.image(image)
        except ValueError as exc:
            raise ShardError(f"sample {sample.sample_id}: {exc}") from None


def to_table(samples: list[Sample]) -> pa.Table:
    for s in samples:
        _check(s)
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for s in samples:
        for name in SCHEMA.names:
            value = getattr(s, name)
            if name in ("reward_info", "meta"):
                value = json.dumps(value)
            elif name == "routes":
                value = encode_routes(value)
            cols[name].append(value)
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def from_table(table: pa.Table) -> list[Sample]:
    out = []
    for row in table.to_pylist():
        row["reward_info"] = json.loads(row["reward_info"] or "{}")
        row["meta"] = json.loads(row["meta"] or "{}")
        try:
            row["routes"] = decode_routes(row["routes"], len(row["input_ids"]))
        except ValueError as exc:
            raise ShardError(f"sample {row['sample_id']}: {exc}") from None
        sample = Sample(**row)
        _check(sample)
        out.append(sample)
    return out


def encode_shard(samples: list[Sample]) -> bytes:
    sink = pa.BufferOutputStream()
    table = to_table(samples)
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class ShardLimits:
    """What a reader accepts of a shard before any value is trusted. `vocab_size`, `max_version`:
    known to the trainer only (its model's vocabulary; its own version, the newest any policy
    token can have been sampled by)."""

    max_bytes: int = 256 << 20
    max_rows: int = 1 << 16
    max_tokens: int = 1 << 17  # per sample; the trainer lowers it to the model's context
    vocab_size: int | None = None
    max_version: int | None = None
    vision_token_ids: tuple[int, ...] = ()  # a VLM's placeholder tokens: prompt-only, never a policy token
    routes: RouteShape | None = None  # the trainer's MoE: recorded routes must fit its layers, k and experts


DEFAULT_LIMITS = ShardLimits()


def shard_limits_for(config: Any) -> ShardLimits:
    """What a reader that knows the policy's HF config accepts of a shard: token ids within its
    vocabulary and samples within its context (a longer one would fail or silently wrap position
    embeddings); a VLM's placeholder tokens never among the policy tokens. The trainer and the
    reward workers read shards so (an out-of-vocabulary id is quarantined, not an IndexError later)."""
    from areal_core.vlm.inputs import vision_token_ids

    text = config.get_text_config()  # a VLM's language model
    context = getattr(text, "max_position_embeddings", None) or DEFAULT_LIMITS.max_tokens
    vision = vision_token_ids(config)
    return replace(DEFAULT_LIMITS, vocab_size=text.vocab_size, max_tokens=context, vision_token_ids=vision)


PER_TOKEN = ("loss_mask", "behav_logprobs", "versions")
REQUIRED_VALUES = ("sample_id", "group_id", "prompt_id", "worker_id", "input_ids", "prompt_len") + PER_TOKEN


def _check_table(table: pa.Table, limits: ShardLimits) -> None:
    """The per-token invariants, vectorised before a row becomes Python objects: equal lengths,
    at most `max_tokens` tokens, token ids in [0, vocab), policy-token versions in [0, max_version],
    no vision placeholder among the policy tokens (a VLM's image tokens belong to the prompt)."""
    if table.num_rows == 0:
        return
    for name in REQUIRED_VALUES:
        if table[name].null_count:
            raise ShardError(f"a sample without {name}")
    for name in ("input_ids",) + PER_TOKEN + ("token_rewards",):
        if pc.list_flatten(table[name]).null_count:
            raise ShardError(f"a sample whose {name} holds a null")
    if not pc.all(pc.is_in(pc.list_flatten(table["loss_mask"]), pa.array([0, 1], pa.int8()))).as_py():
        raise ShardError("a loss_mask value other than 0 or 1")
    lengths = pc.list_value_length(table["input_ids"])
    longest = pc.max(lengths).as_py() or 0
    if longest > limits.max_tokens:
        raise ShardError(f"a sample of {longest} tokens (at most {limits.max_tokens})")
    for name in PER_TOKEN + ("token_rewards",):
        other = pc.list_value_length(table[name])
        same = (
            pc.equal(other, lengths)
            if name != "token_rewards"
            else pc.or_kleene(pc.is_null(other), pc.equal(other, lengths))
        )
        if not pc.all(pc.fill_null(same, False)).as_py():
            raise ShardError(f"a sample whose {name} differs in length from input_ids")
    ids = pc.list_flatten(table["input_ids"])
    lo, hi = pc.min_max(ids).values()
    vocab = limits.vocab_size
    if (lo.as_py() or 0) < 0 or (vocab is not None and (hi.as_py() or 0) >= vocab):
        raise ShardError(f"token ids span [{lo}, {hi}], outside [0, {vocab if vocab is not None else 'inf'})")
    policy = pc.equal(pc.list_flatten(table["loss_mask"]), 1)
    versions = pc.filter(pc.list_flatten(table["versions"]), policy)
    if len(versions):
        vlo, vhi = pc.min_max(versions).values()
        newest = limits.max_version
        if vlo.as_py() < 0 or (newest is not None and vhi.as_py() > newest):
            raise ShardError(f"policy-token versions span [{vlo}, {vhi}], outside [0, {newest}]")
    if limits.vision_token_ids:
        vision = pa.array(limits.vision_token_ids, pa.int32())
        if pc.any(pc.is_in(pc.filter(ids, policy), vision)).as_py():
            raise ShardError(f"a policy token is a vision placeholder {list(limits.vision_token_ids)}")
        if "image_ids" in table.schema.names:  # placeholders stand for images: a row without any has none
            textual = pc.equal(pc.fill_null(pc.list_value_length(table["image_ids"]), 0), 0)
            if pc.any(pc.is_in(pc.list_flatten(pc.filter(table["input_ids"], textual)), vision)).as_py():
                raise ShardError("a row without image_ids holds a vision placeholder")


def decode_shard(data: bytes, limits: ShardLimits = DEFAULT_LIMITS) -> list[Sample]:
    """Parse and validate a shard (ipc_reader.py: no read out of bounds, no inflation, bounded
    rows; then the schema and `_check_table`'s invariants); raises ShardError with the reason."""
    if len(data) > limits.max_bytes:
        raise ShardError(f"{len(data)} bytes (at most {limits.max_bytes})")
    try:
        table = read_ipc_file(data, limits.max_rows)
    except IpcError as exc:
        raise ShardError(str(exc)) from None
    version = (table.schema.metadata or {}).get(b"areal.schema_version", b"").decode(errors="replace")
    if version != SCHEMA_VERSION:
        raise ShardError(f"schema version {version[:40] or 'missing'!r}, expected {SCHEMA_VERSION!r}")
    missing = [n for n in SCHEMA.names if n not in table.schema.names and n not in OPTIONAL_COLUMNS]
    if missing:
        raise ShardError(f"missing columns {missing}")
    for name in OPTIONAL_COLUMNS:
        if name not in table.schema.names:
            table = table.append_column(name, pa.nulls(table.num_rows, SCHEMA.field(name).type))
    try:
        table = table.select(SCHEMA.names).cast(SCHEMA)
        _check_table(table, limits)
        samples = from_table(table)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, json.JSONDecodeError) as exc:
        raise ShardError(f"bad values: {str(exc)[:300]}") from None
    except RecursionError:  # json.loads of a crafted reward_info or meta nested past the interpreter's stack
        raise ShardError("reward_info or meta is nested too deeply") from None
    if limits.routes is not None:
        for sample in samples:
            if sample.routes is not None and (problem := routes_problem(sample.routes, limits.routes)):
                raise ShardError(f"sample {sample.sample_id}: {problem}")
    return samples


def read_shard(store: Store, rel: str, limits: ShardLimits = DEFAULT_LIMITS) -> list[Sample]:
    """The validated samples of the stored shard `rel`, read only if it is a regular file of at most
    `limits.max_bytes`; ShardError with the reason otherwise (FileNotFoundError when it is gone)."""
    try:
        data = store.read_bytes(rel, limits.max_bytes)
    except UnreadableObject as exc:
        raise ShardError(str(exc)) from None
    return decode_shard(data, limits)


def unique(samples: list[Sample], seen: set[str]) -> list[Sample]:
    """The samples whose identity is not in `seen` (nor earlier in `samples`); adds them to `seen`."""
    out = []
    for s in samples:
        key = s.identity()
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def encode_identities(keys: list[str]) -> bytes:
    """A set of sample identities as gzipped text, one a line (a checkpoint's or an online run's record)."""
    return gzip.compress("\n".join(sorted(keys)).encode(), compresslevel=6, mtime=0)


MAX_IDENTITIES_BYTES = 1 << 30  # ~10M identities (a worker id and a sample id each): a gzip bomb stops here


def decode_identities(data: bytes, max_bytes: int | None = None) -> list[str]:
    """The identities `encode_identities` wrote; ValueError when they inflate past `max_bytes`
    (default MAX_IDENTITIES_BYTES; gzip inflates up to ~1000x: the output is capped, not the
    input) or are not one whole gzip member."""
    max_bytes = MAX_IDENTITIES_BYTES if max_bytes is None else max_bytes
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # one gzip member, as gzip.compress writes
    try:
        text = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise ValueError(f"a set of identities that is not gzip ({exc})") from None
    if len(text) > max_bytes or inflater.unconsumed_tail:
        raise ValueError(f"a set of identities that inflates past {max_bytes} bytes")
    if not inflater.eof:
        raise ValueError("a set of identities whose gzip stream is cut short")
    return [key for key in text.decode().split("\n") if key]


def write_shard(store: Store, rel: str, samples: list[Sample]) -> None:
    store.write_bytes(rel, encode_shard(samples))


def quarantine(store: Store, rel: str, reason: str) -> str:
    """Move a bad shard under quarantine/ beside a JSON note with the reason; returns its new path."""
    dst = LAYOUT.quarantined(rel)
    store.move(rel, dst)
    store.write_json(LAYOUT.quarantine_reason(dst), {"source": rel, "reason": reason, "time": time.time()})
    return dst


def shard_rows(store: Store, rel: str) -> int:
    """The rows of a stored shard by the bounded reader alone (no schema check: a shard quarantined
    for its values still counts its rows); 0 for a file that is missing, too big or not Arrow IPC."""
    try:
        data = store.read_bytes(rel, DEFAULT_LIMITS.max_bytes)
        return read_ipc_file(data, DEFAULT_LIMITS.max_rows).num_rows
    except (FileNotFoundError, IpcError, UnreadableObject):
        return 0


class Recorder(Protocol):
    """Where a quarantine is recorded: an `areal_core.events.EventLog` (events sit beside this layer)."""

    def emit(self, kind: str, **fields: Any) -> None: ...


def read_shard_or_quarantine(
    store: Store,
    rel: str,
    events: Recorder | None = None,
    limits: ShardLimits = DEFAULT_LIMITS,
    image_roots: list[Store] | None = None,
    check: Callable[[Sample], str | None] | None = None,
) -> list[Sample] | None:
    """The shard's samples, or None after moving a corrupt shard to quarantine/ (and recording a
    `quarantine` event when `events` is given). A shard whose rows name images is corrupt when one
    of them is missing from `image_roots` (default: the run's own root; a fork's or a replay's
    reader passes dataset.image_roots), altered or undecodable; and when `check(sample)` gives a
    reason (a VLM trainer's vlm.inputs.PlaceholderCheck)."""
    try:
        samples = read_shard(store, rel, limits)
        if any(s.image_ids for s in samples):
            from areal_core.vlm.images import image_problem

            if problem := image_problem(image_roots or [store], [i for s in samples for i in s.image_ids or []]):
                raise ShardError(problem)
        if check is not None and (problem := next((p for x in samples if (p := check(x))), None)):
            raise ShardError(problem)
        return samples
    except ShardError as exc:
        quarantine(store, rel, str(exc))
        if events is not None:
            events.emit("quarantine", path=rel, reason=str(exc)[:300])
        return None
