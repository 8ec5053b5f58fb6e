"""A command MCP server started once and reached over streamable HTTP (`transport: http`).

A stdio server costs a process per episode (its start: the interpreter, the MCP SDK, the tool's
imports, about 2-3 s of CPU for the Python agent's), which on two cores is most of a step. With
`transport: http` the rollout worker starts the command once, on a free port (every `{port}` in
its arguments is replaced by it), and each episode opens its own MCP session on
`http://127.0.0.1:{port}{http_path}`: a server that keeps its state per session (the Python
agent's interpreter) still gives each episode a fresh one, without a new process.

The process is started by the first episode that needs it and waited for, without blocking the
event loop, until *it* listens on its port (a listener of another process on that port is not
taken for it: the port is chosen again). A command that never listens is `connect_timeout`, one
that exits `connect_failed` with its stderr quoted; for `RETRY_AFTER_S` after such a failure the
episodes that ask fail at once with it, rather than each waiting out the timeout again. A process
that died is started again by the next episode (the episodes on it fail as `server_crashed`,
counted). The child leads its own process group and gets SIGTERM when the thread that started it
(the worker's event loop) ends, even by SIGKILL, so no server outlives its worker; `stop()` ends
the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from areal_core.agents.mcp import PROJECT_ROOT, STDERR_TAIL, ServerFailure, ServerSpec
from areal_core.procs import descendants, free_port, kill_group, own_group_dying_with_parent

PORT_FIELD = "{port}"
POLL_S = 0.05
RETRY_AFTER_S = 5.0
PORT_TRIES = 3
STDERR_CAP = 1 << 20  # bytes of a server's stderr kept (the file is emptied past it)
HAVE_PROC_NET = os.path.exists("/proc/net/tcp")  # Linux: who holds a listening socket can be told


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    return inodes


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def holds_socket(pid: int, inodes: set[str]) -> bool:
    """Whether process `pid` has one of the socket `inodes` open."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


class ServedProcess:
    """One command server of `spec` (transport http), shared by the episodes of one environment."""

    def __init__(self, spec: ServerSpec):
        if PORT_FIELD not in " ".join(spec.args):
            raise ValueError(f"MCP server {spec.name!r}: transport http needs {PORT_FIELD} in its args")
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self._stderr = None
        self._lock = threading.Lock()  # episodes of several event loops may ask at once
        self._generation = 0  # bumped by stop(): a start it overlapped gives up
        self._failed: tuple[float, ServerFailure] | None = None

    @property
    def alive(self) -> bool:
        proc = self.proc
        return proc is not None and proc.poll() is None

    async def url_spec(self) -> ServerSpec:
        """The spec an episode connects with (its URL), starting the process first if it is not running.
        ServerFailure when the process does not come up."""
        while not self._lock.acquire(blocking=False):
            await asyncio.sleep(POLL_S)
        try:
            if not self.alive:
                if self._failed is not None and time.monotonic() - self._failed[0] < RETRY_AFTER_S:
                    raise self._failed[1]
                try:
                    await self._start()
                except ServerFailure as exc:
                    self._failed = (time.monotonic(), exc)
                    raise
                self._failed = None
            return dataclasses.replace(
                self.spec, command="", args=(), env=(), url=f"http://127.0.0.1:{self.port}{self.spec.http_path}"
            )
        finally:
            self._lock.release()

    async def _start(self) -> None:
        for _ in range(PORT_TRIES):
            if await self._start_on(free_port()):
                return
        raise self._fail("connect_failed", f"another process took the port each of {PORT_TRIES} times")

    async def _start_on(self, port: int) -> bool:
        """Start the command on `port`; True once it listens there, False when another process does."""
        self._kill()
        generation, self.port = self._generation, port
        from mcp.client.stdio import get_default_environment

        env = {**get_default_environment(), **dict(self.spec.env)}  # what a stdio server gets
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="areal-mcp-http-")
        try:
            self.proc = subprocess.Popen(
                [self.spec.executable(), *[a.replace(PORT_FIELD, str(port)) for a in self.spec.args]],
                cwd=PROJECT_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                preexec_fn=own_group_dying_with_parent(signal.SIGTERM),
            )
        except OSError as exc:
            raise self._fail("connect_failed", f"cannot start {self.spec.command!r}: {exc}") from None
        self.starts += 1
        proc = self.proc
        deadline = time.monotonic() + self.spec.connect_timeout_s
        while True:
            if generation != self._generation:  # stop() ran meanwhile
                self._kill(proc)
                raise self._fail("connect_failed", "the environment was closed while the server started")
            inodes = listening_inodes(port)
            # the command may be a wrapper (sh -c, uv run): the listener is then one of its descendants
            if inodes and any(holds_socket(p, inodes) for p in (proc.pid, *descendants(proc.pid))):
                return True
            if not HAVE_PROC_NET and proc.poll() is None and listening(port):  # no /proc: trust the port
                return True
            if proc.poll() is not None:
                if inodes:  # someone else listens there and ours could not bind: another port
                    return False
                raise self._fail("connect_failed", f"exited with status {proc.returncode}{self.tail()}")
            if time.monotonic() > deadline:
                why = f"not listening on port {port} within {self.spec.connect_timeout_s:g} s{self.tail()}"
                self._kill(proc)
                raise self._fail("connect_timeout", why)
            await asyncio.sleep(POLL_S)

    def _fail(self, kind: str, detail: str) -> ServerFailure:
        return ServerFailure(self.spec.name, kind, detail)

    def tail(self) -> str:
        """The last line of the server's stderr, for a failure's message."""
        err = self._stderr
        if err is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            err.flush()
            size = err.seek(0, os.SEEK_END)
            if size > STDERR_CAP:
                err.truncate(0)
                return ""
            err.seek(max(0, size - 4 * STDERR_TAIL))
            lines = [ln for ln in err.read().splitlines() if ln.strip()]
            if lines:
                return f" (stderr: {' '.join(lines[-1].split())[:STDERR_TAIL]})"
        return ""

    def _kill(self, proc: subprocess.Popen | None = None) -> None:
        """End `proc` (default: the current one) and its process group: SIGTERM, SIGKILL after 5 s."""
        proc = proc or self.proc
        if proc is self.proc:
            self.proc = None
        if proc is None:
            return
        if kill_group(proc.pid, signal.SIGTERM):  # the group, even when its leader is gone already
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid, signal.SIGKILL)
                proc.wait(5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.1)  # reaped, not a zombie
        kill_group(proc.pid, signal.SIGKILL)  # what the leader left behind (sandbox children)

    def stop(self) -> None:
        """End the process group, and a start under way; safe to call twice. A later episode starts it again."""
        self._generation += 1
        self._kill()
        if self._stderr is not None and self.proc is None:
            with contextlib.suppress(OSError):
                self._stderr.close()
            self._stderr = None
