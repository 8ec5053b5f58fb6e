"""Every child process dies with its parent: process groups and the Linux parent-death signal.

- `die_with_parent(sig, parent)`, run in a child (right after fork, or as a Popen preexec_fn):
  the kernel sends `sig` to the child when the thread that started it exits, even by SIGKILL.
  If the parent is already gone (`os.getppid() != parent`), the child exits at once.
- `own_group_dying_with_parent(sig)`: a preexec_fn for a child that leads its own process
  group (so the parent can signal it and all its descendants with `kill_group`).
- `exit_on_sigterm()`: SIGTERM raises SystemExit, so `finally` blocks and context managers that
  stop the process's own children (reward pool, vLLM server) run before it exits.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
# loaded in the parent: a preexec_fn must not import or dlopen after fork
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """In a child: get `sig` when the parent (thread) exits; exit now if `parent` is already gone."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _own_group(sig: int, parent: int) -> None:  # pragma: no cover - runs in the child
    os.setpgid(0, 0)
    die_with_parent(sig, parent)


def own_group_dying_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen preexec_fn: the child leads a new process group and gets `sig` when this process dies."""
    return functools.partial(_own_group, int(sig), os.getpid())


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False when the group has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so cleanup code runs."""
    signal.signal(signal.SIGTERM, _raise_exit)


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid` (Linux /proc), children first; [] elsewhere."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        for child in kids:
            out += [child, *descendants(child)]
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a child started on it may still find it taken: check it bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
