"""The run's report, live: rebuilt from the store every `every_s` seconds on a background thread
while the roles run, and handed to a callback the caller injects (the Flyte task publishes it as
a Deck; areal_core never imports flytekit). The thread runs in a copy of the starter's
contextvars context, so a framework's per-task state (flytekit's execution context) is there.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable

from areal_core.report.html import build_report

log = logging.getLogger("areal.report")

Publish = Callable[[str], None]


class LiveReport:
    """`with LiveReport(run_uri, publish, every_s):` calls `publish(html)` every `every_s` seconds
    (never when `every_s` is 0) until the block ends. A failed build or publish is logged once
    and retried at the next tick; it never stops the run."""

    def __init__(self, run_uri: str, publish: Publish, every_s: float):
        self.run_uri, self.publish, self.every_s = run_uri, publish, every_s
        self.published = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def tick(self) -> None:
        try:
            self.publish(build_report(self.run_uri))
            self.published += 1
        except Exception as exc:  # noqa: BLE001 - a report is never worth a failed run
            if not self._warned:
                log.warning("live report of %s not published (retried): %s: %s", self.run_uri, type(exc).__name__, exc)
                self._warned = True

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()

    def __enter__(self) -> LiveReport:
        if self.every_s > 0:
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(target=ctx.run, args=(self._loop,), name="live-report", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
