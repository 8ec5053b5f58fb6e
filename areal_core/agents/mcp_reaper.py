"""Runs a stdio MCP server so that every process its tools start ends with it:
`python mcp_reaper.py COMMAND [ARGS...]` (run as a script: it imports nothing of the project).

The reaper marks itself a child subreaper (Linux PR_SET_CHILD_SUBREAPER), so a process the server
starts that is orphaned, by a double fork, with or without setsid, is re-parented to the reaper
rather than to init. It starts the server as its child on the same stdin/stdout/stderr (the MCP
wire passes straight through), and when the server exits, or the reaper is told to stop (SIGTERM,
SIGINT, SIGHUP: the MCP SDK's shutdown), it SIGKILLs every process descended from it, reaps them,
and exits with the server's status. A process that leaves through both a setsid and a reparent to
another subreaper, or a reaper killed by SIGKILL, escapes: the PID-namespace sandbox of code
rewards is the stronger containment, but a server that runs bwrap itself cannot run inside one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in kids:
            out += [child, *descendants(child)]
    return out


def kill_all() -> None:
    """SIGKILL every descendant until none is left (a fork racing the kill is caught next round)."""
    for _ in range(50):
        tree = descendants(os.getpid())
        if not tree:
            return
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:  # reap what died (our children, and orphans re-parented to us)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def main() -> int:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def stop(signum: int, frame: object) -> None:
        kill_all()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    server = subprocess.Popen(sys.argv[1:])
    status = server.wait()
    kill_all()
    return status


if __name__ == "__main__":
    sys.exit(main())
