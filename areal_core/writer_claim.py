"""One live writer per shard writer id. Shards are named `{worker}/{seq:08d}.arrow`, so two writers
with one id (two proxies both left at `--worker-id proxy-0`) would write the same names and one's
rows would replace the other's. A writer claims its id in the store before writing,
`writers/{worker}.json` (holder, host, pid, heartbeat), by a conditional write, as a run claims its
root (run/ownership.py): a second writer whose id has a live claim is refused at start with the
fix in the message; a claim not renewed for `timeout_s` (or whose process on this host is gone) is
stale and taken over. The holder renews it every `interval_s` on a thread and releases it at close.
The writers also create their shards only where no shard is (proxy/shards.py), so even a writer
that lost its claim never overwrites a row.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from areal_core.layout import LAYOUT
from areal_core.procs import pid_alive
from areal_core.store import Store

log = logging.getLogger("areal.writers")

MAX_CLAIM_BYTES = 4096


class WriterInUse(RuntimeError):
    """Another live writer holds this worker id."""


def _live(raw: dict, timeout_s: float) -> bool:
    if raw.get("state") != "running":
        return False
    beat = raw.get("heartbeat")
    # a heartbeat from the future (a forged claim, or a clock far ahead) holds no id for ever
    if not isinstance(beat, (int, float)) or not -timeout_s <= time.time() - beat <= timeout_s:
        return False
    pid = raw.get("pid")
    return not (raw.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid))


class WriterClaim:
    """The claim of `worker` in `store`, held from construction until `release()` (module docstring)."""

    def __init__(self, store: Store, worker: str, timeout_s: float = 60.0, interval_s: float = 10.0):
        if interval_s * 2 > timeout_s:
            raise ValueError("interval_s must be at most half of timeout_s")
        self.store, self.worker, self.timeout_s, self.interval_s = store, worker, timeout_s, interval_s
        self.rel = LAYOUT.writer_claim(worker)
        self.holder = uuid.uuid4().hex[:12]
        self.lost: str | None = None
        current = store.read_versioned(self.rel)
        token = None
        if current is not None:
            data, token = current
            raw = self._decode(data)
            ours = raw.get("host") == socket.gethostname() and raw.get("pid") == os.getpid()  # an earlier writer here
            if _live(raw, timeout_s) and not ours:
                raise WriterInUse(
                    f"worker id {worker!r} in {store.uri} is held by a live writer (host {raw.get('host')}, pid "
                    f"{raw.get('pid')}, heartbeat {time.time() - raw['heartbeat']:.0f}s ago): give this one its own "
                    f"id (e.g. --worker-id {worker}-2), or stop the other; a claim not renewed for {timeout_s:g}s "
                    "is taken over"
                )
        if not store.write_if(self.rel, self._encode("running"), token):
            raise WriterInUse(f"worker id {worker!r} in {store.uri} was claimed by another writer just now")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"claim-{worker}", daemon=True)
        self._thread.start()

    def _encode(self, state: str) -> bytes:
        body = {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        return json.dumps({**body, "state": state}).encode()

    @staticmethod
    def _decode(data: bytes) -> dict:
        """A claim's fields; an unreadable or oversized claim counts as stale (nothing to honour)."""
        if len(data) > MAX_CLAIM_BYTES:
            return {}
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def _renew(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                current = self.store.read_versioned(self.rel)
                if current is None or self._decode(current[0]).get("holder") != self.holder:
                    self.lost = "the claim was taken over or removed"
                    log.error("writer %s: %s; its shards still go only under free names", self.worker, self.lost)
                    return
                self.store.write_if(self.rel, self._encode("running"), current[1])
            except Exception as exc:  # noqa: BLE001 - a store outage: retried at the next interval
                log.warning("writer %s: renewing its claim failed: %s", self.worker, exc)

    def release(self) -> None:
        """Stop renewing; mark the claim released (if it is still ours)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        current = self.store.read_versioned(self.rel)
        if current is not None and self._decode(current[0]).get("holder") == self.holder:
            self.store.write_if(self.rel, self._encode("released"), current[1])
