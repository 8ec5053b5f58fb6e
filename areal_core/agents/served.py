"""A command MCP server started once and reached over streamable HTTP (`transport: http`).

A stdio server costs a process per episode (its start: the interpreter, the MCP SDK, the tool's
imports, about 2-3 s of CPU for the Python agent's), which on two cores is most of a step. With
`transport: http` the rollout worker starts the command once, on a free port (every `{port}` in
its arguments is replaced by it), and each episode opens its own MCP session on
`http://127.0.0.1:{port}{http_path}`: a server that keeps its state per session (the Python
agent's interpreter) still gives each episode a fresh one, without a new process.

The process is started lazily by the first episode, waited for until its port accepts connections
(bounded by the spec's connect timeout: a command that never listens is `connect_timeout`, one that
exits is `connect_failed`, its stderr quoted), restarted by the next episode when it has died (the
episodes on it fail as `server_crashed`, counted), and stopped with its process group on `close()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

from areal_core.agents.mcp import PROJECT_ROOT, STDERR_TAIL, ServerFailure, ServerSpec

PORT_FIELD = "{port}"
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


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
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def url_spec(self) -> ServerSpec:
        """The spec an episode connects with (its URL), starting the process first if it is not running.
        Blocking: call it from a thread. ServerFailure when the process does not come up."""
        with self._lock:
            if not self.alive:
                self._start()
            return dataclasses.replace(
                self.spec, command="", args=(), env=(), url=f"http://127.0.0.1:{self.port}{self.spec.http_path}"
            )

    def _start(self) -> None:
        self.stop()
        self.port = free_port()
        args = [a.replace(PORT_FIELD, str(self.port)) for a in self.spec.args]
        env = {**os.environ, **dict(self.spec.env)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="areal-mcp-http-")
        try:
            self.proc = subprocess.Popen(
                [self.spec.executable(), *args],
                cwd=PROJECT_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,  # its own process group: stop() ends what it started too
            )
        except OSError as exc:
            raise ServerFailure(
                self.spec.name, "connect_failed", f"cannot start {self.spec.command!r}: {exc}"
            ) from None
        self.starts += 1
        deadline = time.monotonic() + self.spec.connect_timeout_s
        while not listening(self.port):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ServerFailure(self.spec.name, "connect_failed", f"exited with status {code}{self.tail()}")
            if time.monotonic() > deadline:
                why = f"not listening on port {self.port} within {self.spec.connect_timeout_s:g} s{self.tail()}"
                self.stop()
                raise ServerFailure(self.spec.name, "connect_timeout", why)
            time.sleep(POLL_S)

    def tail(self) -> str:
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
            self._stderr.seek(0)
            lines = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
            if lines:
                return f" (stderr: {' '.join(lines[-1].split())[:STDERR_TAIL]})"
        return ""

    def stop(self) -> None:
        """End the process group (SIGTERM, then SIGKILL after 5 s); safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()
            self._stderr = None
