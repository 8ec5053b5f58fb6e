"""One piece of the trainer's store work in flight on a helper thread (issue 57: idle cores).

The trainer's step is its own math (forward, backward, optimizer: one core under
`threads_per_role`); writing a version to the store (sha256, files, MANIFEST.json, LATEST, pruning) is
I/O and hashing that release the GIL. `InFlight` runs that work on one helper thread while the next
step trains, so it lands on a core the trainer's thread leaves idle, and never changes the math.

At most one job is in flight: `submit` first waits for the previous one, so versions reach the
store in order and LATEST is written only after its version's files and manifest, as before
(weights/publisher.py). `drain()` waits for the job in flight and raises its exception on the
trainer's thread; the sink drains before a checkpoint (so a checkpoint never runs ahead of the
versions before it), before a repair, and before the final model. A crash with a job in flight
leaves what a crash inside a synchronous publication leaves: no LATEST for the unfinished version
(train/lineage.py reads the store either way).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class InFlight:
    """`background` False: `submit` runs the job at once on the caller's thread (the same order, no helper)."""

    def __init__(self, background: bool, name: str = "publish"):
        self.background = background
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if background else None
        self._job: Future | None = None

    def submit(self, job: Callable[[], Any]) -> Any:
        """Run `job` after the one in flight: on the helper thread (returns None) or here (returns its result)."""
        self.drain()
        if self._pool is None:
            return job()
        self._job = self._pool.submit(job)
        return None

    def drain(self) -> Any:
        """Wait for the job in flight (if any) and return its result; its exception is raised here."""
        job, self._job = self._job, None
        return job.result() if job is not None else None

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done()

    def close(self) -> None:
        """Drain, then stop the helper thread."""
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
