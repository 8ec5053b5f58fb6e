"""Memory a measured block adds, for the benchmarks that report it (scale.py, logit_memory.py)."""

from __future__ import annotations

import os
import resource


def _rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _current_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


class AddedMemory:
    """Memory a block adds above the process's resident set when it starts: max(current RSS sampled
    every 2 ms, ru_maxrss where the block raised it) - RSS at start. ru_maxrss alone reads 0
    when an earlier phase (imports, building the model) peaked higher; glibc's growing mmap threshold
    would hide reused heap, so it is fixed at 64 KiB and the heap trimmed before the start."""

    def __enter__(self) -> AddedMemory:
        import ctypes
        import threading

        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: fixed, so large frees go back to the kernel
            libc.malloc_trim(0)
        except OSError:
            pass
        self.start, self.max_before, self.peak = _current_mb(), _rss_mb(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _current_mb())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        after = _rss_mb()
        self.peak = max(self.peak, _current_mb(), after if after > self.max_before else 0)

    @property
    def added_mb(self) -> int:
        return max(0, self.peak - self.start)
