"""What a report is built from, read from a run root: a past, crashed or running run."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from areal_core.config import ConfigError
from areal_core.events import read_events
from areal_core.layout import LAYOUT
from areal_core.report.answers import HeldoutAnswers, load_answers
from areal_core.store import Store


class NotARun(ConfigError):
    """The root holds no run (no config.yaml)."""


@dataclasses.dataclass
class RunData:
    uri: str
    records: list[dict[str, Any]]  # every event record (events.read_events)
    rows: list[dict[str, Any]]  # trainer/metrics.jsonl
    audits: list[dict[str, Any]]  # trainer/trained/step-N.json, read only when no `trained` events
    done: bool
    config: dict[str, Any]
    answers: HeldoutAnswers = dataclasses.field(default_factory=lambda: HeldoutAnswers([], "not recorded"))


def _jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write of a hand-copied root
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append(row)
    return out


def load_run(store: Store) -> RunData:
    """The run's events, metrics rows, (when the events have no `trained` records) audit records
    and recorded held-out answers. NotARun when the root holds no config.yaml."""
    from areal_core.config import ConfigError
    from areal_core.config.base import MAX_YAML_BYTES, load_yaml_text
    from areal_core.store import UnreadableObject

    if not store.exists(LAYOUT.config):
        raise NotARun(f"{store.uri} is not a run root (no {LAYOUT.config})")
    records = read_events(store)
    rows = _jsonl(store.read_text(LAYOUT.metrics)) if store.exists(LAYOUT.metrics) else []
    audits: list[dict[str, Any]] = []
    if not any(r.get("kind") == "trained" for r in records):
        audits = [store.read_json(p) for p in store.find(LAYOUT.trained_dir, ".json")]
    try:  # bounded (config/base.py): a hostile config.yaml cannot hang the report
        config = load_yaml_text(store.read_bytes(LAYOUT.config, MAX_YAML_BYTES), LAYOUT.config) or {}
    except (ConfigError, UnreadableObject):
        config = {}
    config = config if isinstance(config, dict) else {}
    return RunData(store.uri, records, rows, audits, store.done(), config, load_answers(store))
