"""The Python agent's MCP server: `run_python(code)` in the project's bubblewrap sandbox.

    python -m examples.python_agent.server [--wall-s 5] [--cpu-s 3] [--max-output 1000] [--http PORT]

Each call runs in a fresh sandbox through `areal_core.reward.sandbox.Sandbox.run`, the sandbox's
public entry point (no network, read-only system, private /tmp, CPU, memory, process and file
limits, a wall clock): the same one code rewards use. The interpreter is stateful within a
session: the cells that ran without error are replayed first (their output discarded), so
`x = 21` then `print(x * 2)` prints 42. Each MCP session has its own interpreter: over stdio a
session is a process (one per episode), over streamable HTTP (`--http PORT`, what
`transport: http` in configs/agent_python.yaml starts once per rollout worker) one process holds
a session per episode, so each episode still starts empty without a new process. A cell whose last statement is an
expression prints its value, as a REPL does. Output past `--max-output` characters is cut and
the cut is said; a cell that errs returns the error's last line, one past the limit says so.
Without a working bubblewrap the server does not start: the episode fails as `connect_failed`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import OrderedDict

from mcp.server.mcpserver import Context, MCPServer

from areal_core.reward.sandbox import Limits, Sandbox

PROGRAM = """\
import ast as _ast, contextlib as _cl, io as _io
_CELLS = {cells!r}


def _run(_src, _echo):
    _tree = _ast.parse(_src)
    _last = None
    if _echo and _tree.body and isinstance(_tree.body[-1], _ast.Expr):
        _last = _ast.Expression(_tree.body.pop().value)
    exec(compile(_tree, "<cell>", "exec"), globals())
    if _last is not None:
        _value = eval(compile(_last, "<cell>", "eval"), globals())
        if _value is not None:
            print(repr(_value))


with _cl.redirect_stdout(_io.StringIO()), _cl.redirect_stderr(_io.StringIO()):
    for _cell in _CELLS[:-1]:
        try:
            _run(_cell, False)
        except Exception:
            pass
_run(_CELLS[-1], True)
"""


MAX_SESSIONS = 1024  # interpreters kept; an episode's session is used for seconds, then ended


class Interpreter:
    """One session's cells, run in the sandbox."""

    def __init__(self, sandbox: Sandbox, limits: Limits, max_output: int):
        self.sandbox, self.limits, self.max_output = sandbox, limits, max_output
        self.cells: list[str] = []
        self.lock = asyncio.Lock()  # one cell at a time: they share the session's state

    def run(self, code: str) -> str:
        result = self.sandbox.run(PROGRAM.format(cells=[*self.cells, code]))
        out = result.stdout
        if result.timed_out:
            return (
                self._cut(out) + ("\n" if out else "") + f"error: the code ran past the {self.limits.wall_s:g} s limit"
            )
        if not result.ok:
            lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
            why = result.reason if result.returncode and result.returncode < 0 else ""
            why = why or (lines[-1] if lines else result.reason or f"exit status {result.returncode}")
            return self._cut(out) + ("\n" if out else "") + f"error: {why}"
        self.cells.append(code)
        return self._cut(out.rstrip("\n")) or "(no output)"

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output:
            return text
        return text[: self.max_output] + f"\n[output cut: {self.max_output} of {len(text)} characters shown]"


def build(wall_s: float, cpu_s: int, max_output: int, http: bool = False) -> MCPServer:
    """The server; `http`: sessions are the clients' MCP sessions, and a call outside one is refused.
    Raises SandboxUnavailable without a working bubblewrap, so the server never starts without it."""
    limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=512, fsize_mb=2)
    sandbox = Sandbox(limits)  # checks bubblewrap now, not at the first call
    server = MCPServer("python", log_level="WARNING")
    # an episode's session is used for seconds and then ended; the least recently used goes first
    sessions: OrderedDict[str, Interpreter] = OrderedDict()

    @server.tool()
    async def run_python(code: str, ctx: Context) -> str:
        """Run Python code (state is kept between calls); returns what it printed, or its error."""
        # over HTTP the session is the client's MCP session (the handshake's mcp-session-id);
        # over stdio the process is the session
        key = (ctx.headers or {}).get("mcp-session-id") if http else "stdio"
        if not key:
            return "error: run_python keeps state per MCP session; connect with one (the initialize handshake)"
        interpreter = sessions.get(key)
        if interpreter is None:
            interpreter = sessions[key] = Interpreter(sandbox, limits, max_output)
            while len(sessions) > MAX_SESSIONS:
                sessions.popitem(last=False)
        sessions.move_to_end(key)
        async with interpreter.lock:
            return await asyncio.to_thread(interpreter.run, code)

    return server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wall-s", type=float, default=5.0, help="wall-clock limit per call, replay included")
    ap.add_argument("--cpu-s", type=int, default=3, help="CPU seconds per call (per process of the sandbox)")
    ap.add_argument("--max-output", type=int, default=1000, help="characters of output returned")
    ap.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port (0: stdio)")
    a = ap.parse_args()
    server = build(a.wall_s, a.cpu_s, a.max_output, http=bool(a.http))
    if a.http:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
