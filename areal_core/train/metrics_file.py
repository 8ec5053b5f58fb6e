"""The trainer's metrics file (`LAYOUT.metrics`): one JSON row per step, written off the step's critical path.

A store object cannot be appended to, so the file is rewritten whole; doing that every step
costs O(n²) bytes over a run. It is rewritten at most every `flush_every_s`, and always at the
rows that must not be lost: evaluations, checkpoint steps (a resume keeps the rows up to its
checkpoint) and the last step.
"""

from __future__ import annotations

import json
import time

from areal_core.layout import LAYOUT
from areal_core.store import Store

FLUSH_EVERY_S = 2.0


class MetricsFile:
    def __init__(self, store: Store, resume_step: int, flush_every_s: float = FLUSH_EVERY_S):
        """The rows of steps ≤ `resume_step` already in the store are kept (a resumed run)."""
        self.store, self.flush_every_s = store, flush_every_s
        self.lines: list[str] = []
        if store.exists(LAYOUT.metrics):
            old = store.read_text(LAYOUT.metrics).splitlines()
            self.lines = [line for line in old if line and json.loads(line)["step"] <= resume_step]
        self._flushed = time.monotonic()

    def append(self, row: dict, must_write: bool = False) -> None:
        self.lines.append(json.dumps(row))
        if must_write or time.monotonic() - self._flushed >= self.flush_every_s:
            self.store.write_text(LAYOUT.metrics, "\n".join(self.lines) + "\n")
            self._flushed = time.monotonic()
