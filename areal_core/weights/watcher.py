"""The one weight watcher: a thread that polls weights/LATEST and hands each newer version on.

What a version means to its receiver is the callback's business (an in-process engine reads,
verifies and stages a state dict; a remote engine has its server reload). The watcher only
decides when: `on_version(v)` is called with the newest published version whenever it is
newer than the last one delivered.

Failures: a WeightsError (a version half-pruned, racing its publication or failing a
checksum) is counted and the same version is tried again at the next poll; it is logged at the
first failure and at every doubling of the count (never a line per poll), and each failure is
handed to `on_failure(version, failures_in_a_row, error)` (a rollout worker reports it to the
trainer: weights/faults.py). Any other error (e.g. the inference server died) is kept in `error`,
wakes `wait`, and ends the thread, so the owner can raise it on its own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from areal_core.store import Store
from areal_core.weights import WeightsError

log = logging.getLogger("areal.weights")


class WeightWatcher:
    """Polls LATEST every `poll_interval_s` and calls `on_version` for each newer version.

    `version` is the newest version delivered (starts at `version`, the one already loaded);
    `wait(timeout)` blocks until a new version was delivered or the watcher failed.
    """

    def __init__(
        self,
        store: Store,
        on_version: Callable[[int], None],
        poll_interval_s: float,
        *,
        version: int = -1,
        on_failure: Callable[[int, int, WeightsError], None] | None = None,
    ):
        self.store, self.on_version, self.poll_interval_s = store, on_version, poll_interval_s
        self.version = version
        self.on_failure = on_failure
        self.failing: tuple[int, int] | None = None  # (newest version tried, failures in a row) until one loads
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._new = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)

    def start(self) -> WeightWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling and join (a daemon thread left inside torch at exit aborts the process)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def halt(self) -> None:
        """Stop polling after the current poll, without waiting (callable on the watcher's own thread)."""
        self._stop.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a new version (or a failure); True if one came. Clears the signal."""
        came = self._new.wait(timeout)
        self._new.clear()
        return came

    def _run(self) -> None:
        unreadable = 0  # LATEST (or a proxy's source) unreadable, in a row: logged, never a load failure
        while not self._stop.is_set():
            try:  # the store retries transient errors itself; what still fails stops the owner
                try:
                    latest = self.store.latest_version()
                    unreadable = 0
                except WeightsError as exc:  # e.g. a registry outage (proxy/versions.py: SourceUnavailable)
                    unreadable += 1
                    if unreadable & (unreadable - 1) == 0:
                        log.warning("the newest version cannot be read (%d in a row): %s", unreadable, exc)
                    latest = None
                if latest is not None and latest > self.version:
                    try:
                        self.on_version(latest)
                    except WeightsError as exc:
                        self._failed(latest, exc)
                    else:
                        self.version, self.failing = latest, None
                        self._new.set()
            except Exception as exc:  # noqa: BLE001 - handed to the owner's thread
                self.error = exc
                self._new.set()
                return
            self._stop.wait(self.poll_interval_s)

    def _failed(self, v: int, exc: WeightsError) -> None:
        n = self.failing[1] + 1 if self.failing is not None else 1  # in a row, across versions: a broken
        # delta chain fails every newer version too
        self.failing = (v, n)
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...
            log.warning("weights v%d failed to load (%d in a row): %s", v, n, exc)
        if self.on_failure is not None:
            try:
                self.on_failure(v, n, exc)
            except Exception as report_exc:  # noqa: BLE001 - a report that fails is retried when next due
                log.warning("reporting weights v%d failed: %s", v, report_exc)
