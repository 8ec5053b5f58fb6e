"""Human labels joined into grading, and preference pairs exported for DPO.

Labels table: any number of `*.parquet` / `*.jsonl` files under `labels/` on the run's store,
read in name order (a later row for the same key wins). Columns:

    sample_id  str   label one sample (wins over a prompt_id label)       } one of the
    prompt_id  str   label every sample of a prompt                       } two is needed
    reward     float the reward to use instead of the verifier's (optional)
    label      str   a free-form verdict ("good", "wrong units", ...) (optional)
    annotator  str   who labelled it (optional)
    note       str   anything else (optional)

`apply_labels(samples, labels)` (what the reward worker calls after grading a shard)
overrides `reward` where a label has one, keeps the verifier's value in
`reward_info["model_reward"]`, records the label in `reward_info["label"]`, and drops
per-token rewards of a sample whose scalar it replaced (they belonged to the old grade).

`export_preference_pairs(store)` reads the graded shards, groups samples by prompt, and
writes chosen/rejected pairs to `exports/preference_pairs.parquet`: per prompt the best vs
the worst sample (`mode="best_worst"`) or every pair (`mode="all"`), whenever their rewards
differ by more than `min_margin`.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from areal_core.layout import LAYOUT, BadName
from areal_core.protocol import Sample, ShardError, read_shard, unique
from areal_core.store import Store, UnreadableObject

LABEL_FIELDS = ("sample_id", "prompt_id", "reward", "label", "annotator", "note")
LABELS_FILE_BYTES = 256 << 20  # one labels file; a larger one is refused before it is read


class LabelsError(ValueError):
    """A labels file or row that cannot be used; the message names the file and row."""


@dataclass
class Labels:
    by_sample: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_prompt: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_sample) + len(self.by_prompt)

    def lookup(self, sample: Sample) -> dict[str, Any] | None:
        return self.by_sample.get(sample.sample_id) or self.by_prompt.get(sample.prompt_id)

    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]], source: str = "rows") -> Labels:
        out = cls()
        for i, raw in enumerate(rows):
            row = _clean_row(raw, f"{source} row {i}")
            row["source"] = source
            if row.get("sample_id"):
                out.by_sample[row["sample_id"]] = row
            else:
                out.by_prompt[row["prompt_id"]] = row
        return out

    def update(self, other: Labels) -> None:
        self.by_sample.update(other.by_sample)
        self.by_prompt.update(other.by_prompt)


def _clean_row(raw: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise LabelsError(f"{where}: a label is an object, not {type(raw).__name__}")
    row = {k: raw.get(k) for k in LABEL_FIELDS if raw.get(k) is not None}
    for key in ("sample_id", "prompt_id"):
        if key in row:
            row[key] = str(row[key])
    if not row.get("sample_id") and not row.get("prompt_id"):
        raise LabelsError(f"{where}: needs a sample_id or a prompt_id")
    if "reward" in row:
        try:
            row["reward"] = float(row["reward"])
        except (TypeError, ValueError):
            raise LabelsError(f"{where}: reward {row['reward']!r} is not a number") from None
        if not math.isfinite(row["reward"]):
            raise LabelsError(f"{where}: reward {row['reward']} is not finite")
    return row


def read_label_rows(store: Store, rel: str) -> list[dict[str, Any]]:
    """The rows of one labels file; LabelsError naming the file (and line) for a file that is not
    regular, over LABELS_FILE_BYTES, not Parquet, not UTF-8, or a line that is not JSON."""
    try:
        data = store.read_bytes(rel, LABELS_FILE_BYTES)
    except UnreadableObject as exc:
        raise LabelsError(str(exc)) from None  # it names the file
    if rel.endswith(".parquet"):
        try:
            return pq.read_table(pa.BufferReader(data)).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise LabelsError(f"{rel}: not a readable Parquet file: {str(exc)[:300]}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LabelsError(f"{rel}: not UTF-8 text (byte {exc.start})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise LabelsError(f"{rel} line {n}: not JSON ({exc.msg})") from None
            except RecursionError:
                raise LabelsError(f"{rel} line {n}: nested too deeply") from None
    return rows


def load_labels(
    store: Store, prefix: str = LAYOUT.labels_dir, on_error: Callable[[str, LabelsError], None] | None = None
) -> Labels:
    """Every labels file under `prefix`, in name order; an empty table when there is none.
    A file that cannot be used raises LabelsError, or with `on_error` is reported to it and skipped
    (a running reward worker keeps grading with the other files)."""
    labels = Labels()
    for rel in store.find(prefix):
        if rel.endswith((".parquet", ".jsonl")):
            try:
                labels.update(Labels.from_rows(read_label_rows(store, rel), source=rel))
            except LabelsError as exc:
                if on_error is None:
                    raise
                on_error(rel, exc)
    return labels


def write_labels(store: Store, rows: list[dict[str, Any]], name: str = "labels.parquet") -> str:
    """Validate and publish a labels file under labels/ (Parquet or JSONL by its name); returns its
    path. `name` is one file name (layout.check_name: no separator, not '.', '..' or hidden)."""
    try:
        rel = LAYOUT.labels_file(name)
    except BadName as exc:
        raise LabelsError(str(exc)) from None
    clean = [_clean_row(r, f"row {i}") for i, r in enumerate(rows)]
    if name.endswith(".jsonl"):
        store.write_text(rel, "".join(json.dumps(r) + "\n" for r in clean))
    elif name.endswith(".parquet"):
        cols = {k: [r.get(k) for r in clean] for k in LABEL_FIELDS}
        schema = pa.schema([(k, pa.float64() if k == "reward" else pa.string()) for k in LABEL_FIELDS])
        buf = io.BytesIO()
        pq.write_table(pa.table(cols, schema=schema), buf)
        store.write_bytes(rel, buf.getvalue())
    else:
        raise LabelsError(f"labels file {name!r}: use a .parquet or .jsonl name")
    return rel


def apply_labels(samples: list[Sample], labels: Labels | Iterable[dict[str, Any]]) -> list[Sample]:
    """Join labels into graded samples (in place, and returned): see the module docstring."""
    if not isinstance(labels, Labels):
        labels = Labels.from_rows(labels)
    if not len(labels):
        return samples
    for s in samples:
        row = labels.lookup(s)
        if row is None:
            continue
        record = dict(row)
        record["key"] = "sample_id" if row.get("sample_id") else "prompt_id"
        info = dict(s.reward_info or {})
        if "reward" in row:
            info["model_reward"] = s.reward
            if info.pop("skipped", None):  # the reward functions skipped it; the label's reward is trained on
                record["model_skipped"] = True
            s.reward = row["reward"]
            if s.token_rewards is not None:
                s.token_rewards = None
                record["dropped_token_rewards"] = True
        info["label"] = record
        s.reward_info = info
    return samples


def preference_pairs(
    samples: list[Sample],
    mode: str = "best_worst",
    min_margin: float = 0.0,
    decode: Callable[[list[int]], str] | None = None,
) -> list[dict[str, Any]]:
    """Chosen/rejected pairs within each prompt's graded samples (ungraded ones are left out, and so
    are those every reward function skipped: their 0 is no grade)."""
    if mode not in ("best_worst", "all"):
        raise ValueError(f"mode {mode!r}: use 'best_worst' or 'all'")
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        if s.reward is not None and math.isfinite(s.reward) and (s.reward_info or {}).get("skipped") is not True:
            groups.setdefault(s.prompt_id, []).append(s)
    pairs = []
    for prompt_id in sorted(groups):
        ranked = sorted(groups[prompt_id], key=lambda s: (-s.reward, s.sample_id))
        if mode == "best_worst":
            candidates = [(ranked[0], ranked[-1])] if len(ranked) > 1 else []
        else:
            candidates = [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1 :]]
        for chosen, rejected in candidates:
            if chosen.reward - rejected.reward <= min_margin:
                continue
            labelled = "label" in chosen.reward_info and "label" in rejected.reward_info
            pair = {
                "prompt_id": prompt_id,
                "chosen_sample_id": chosen.sample_id,
                "rejected_sample_id": rejected.sample_id,
                "chosen_reward": float(chosen.reward),
                "rejected_reward": float(rejected.reward),
                "source": "label" if labelled else "reward",
                "prompt_ids": chosen.input_ids[: chosen.prompt_len],
                "chosen_ids": chosen.response_ids(),
                "rejected_ids": rejected.response_ids(),
            }
            if decode is not None:
                pair["prompt"] = decode(pair["prompt_ids"])
                pair["chosen"] = decode(pair["chosen_ids"])
                pair["rejected"] = decode(pair["rejected_ids"])
            pairs.append(pair)
    return pairs


PAIR_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("chosen_sample_id", pa.string()),
        ("rejected_sample_id", pa.string()),
        ("chosen_reward", pa.float32()),
        ("rejected_reward", pa.float32()),
        ("source", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("chosen_ids", pa.list_(pa.int32())),
        ("rejected_ids", pa.list_(pa.int32())),
    ]
)


def read_graded(store: Store, prefix: str = LAYOUT.graded_dir) -> tuple[list[Sample], int]:
    """All samples of the graded shards under `prefix`, each once (by `Sample.identity()`: a copied
    shard adds nothing), and the number of unreadable shards skipped."""
    samples: list[Sample] = []
    bad, seen = 0, set()
    for rel in store.find(prefix, ".arrow"):
        try:
            samples.extend(unique(read_shard(store, rel), seen))
        except ShardError:
            bad += 1
    return samples, bad


def export_preference_pairs(
    store: Store,
    out: str = LAYOUT.preference_pairs,
    mode: str = "best_worst",
    min_margin: float = 0.0,
    decode: Callable[[list[int]], str] | None = None,
    labels: Labels | None = None,
) -> dict[str, int]:
    """Pairs from the store's graded shards (labels joined first when given) -> Parquet at `out`."""
    samples, bad = read_graded(store)
    if labels is not None:
        apply_labels(samples, labels)
    pairs = preference_pairs(samples, mode, min_margin, decode)
    schema = PAIR_SCHEMA
    if decode is not None:
        schema = schema.append(pa.field("prompt", pa.string()))
        schema = schema.append(pa.field("chosen", pa.string())).append(pa.field("rejected", pa.string()))
    table = pa.table({name: [p[name] for p in pairs] for name in schema.names}, schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    store.write_bytes(out, buf.getvalue())
    return {
        "pairs": len(pairs),
        "samples": len(samples),
        "prompts": len({s.prompt_id for s in samples}),
        "bad_shards": bad,
    }
