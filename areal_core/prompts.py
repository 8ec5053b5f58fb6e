"""The prepared prompt set on the store: prompts/part-*.parquet (prompt_id, prompt, answer, meta, split)."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from areal_core.layout import LAYOUT
from areal_core.store import Store

ROWS_PER_PART = 50_000


def write_prompts(store: Store, train: list[dict[str, Any]], held_out: list[dict[str, Any]]) -> int:
    rows = [dict(r, split="train") for r in train] + [dict(r, split="eval") for r in held_out]
    for part, start in enumerate(range(0, len(rows), ROWS_PER_PART)):
        chunk = rows[start : start + ROWS_PER_PART]
        table = pa.table(
            {
                "prompt_id": [r["prompt_id"] for r in chunk],
                "prompt": [r["prompt"] for r in chunk],
                "answer": [r["answer"] for r in chunk],
                "meta": [json.dumps(r.get("meta", {})) for r in chunk],
                "split": [r["split"] for r in chunk],
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf)
        store.write_bytes(LAYOUT.prompts_part(part), buf.getvalue())
    return len(rows)


def load_prompts(store: Store, split: str | None = None) -> list[dict[str, Any]]:
    parts = store.find(LAYOUT.prompts_dir, ".parquet")
    if not parts:
        raise FileNotFoundError(f"no prompts under {store.url(LAYOUT.prompts_dir)}: run the prepare step first")
    rows: list[dict[str, Any]] = []
    for part in parts:
        rows.extend(pq.read_table(io.BytesIO(store.read_bytes(part))).to_pylist())
    for r in rows:
        r["meta"] = json.loads(r["meta"])
    return [r for r in rows if split is None or r["split"] == split]
