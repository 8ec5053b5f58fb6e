"""Misbehaving MCP servers for tests/test_mcp.py, run as `python tests/test_mcp_servers.py MODE`.

silent     reads stdin and never answers (a server that hangs at start)
bad        an `MCPServer` whose tools misbehave: `malformed` answers its own request with a
           result of the wrong shape, `latin1` with bytes that are not UTF-8, `huge` returns
           3 MB, `crash` exits the process mid-call, `echo` behaves
spawner    a tool `spawn(how, seconds)` that starts `sleep <seconds>` as a plain child, after setsid,
           or as an orphan of a double fork, and returns its pid
search     `search LABEL [BANNER]`: a server named LABEL whose `search(query)` answers
           `LABEL found <query>` and whose `chatter(lines)` first writes that many lines that are
           not JSON-RPC onto the wire (a chatty server's stdout), after BANNER such lines printed
           at start, before the SDK takes stdout
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__" and sys.argv[1:] == ["silent"]:  # before the SDK's import: a quick start
    sys.stdin.read()
    sys.exit(0)

from mcp.server.mcpserver import Context, MCPServer  # noqa: E402


def _answer(request_id: str, result_bytes: bytes) -> None:
    """Write a JSON-RPC response for `request_id` straight to the wire, past the SDK (which moved
    stdout aside: fd 1 is now stderr, the wire a private duplicate)."""
    from mcp.server import stdio

    wire = next(c.private_fd for c in stdio._claims.values() if c.fd == 1)
    rid = int(request_id) if request_id.lstrip("-").isdigit() else json.dumps(request_id)
    os.write(wire, b'{"jsonrpc": "2.0", "id": ' + str(rid).encode() + b', "result": ' + result_bytes + b"}\n")


def _wire_write(data: bytes) -> None:
    """Write all of `data` onto the wire (the SDK's private duplicate of stdout), past the SDK."""
    import select

    from mcp.server import stdio

    wire = next(c.private_fd for c in stdio._claims.values() if c.fd == 1)
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(wire, view) :]
        except BlockingIOError:
            select.select([], [wire], [], 1.0)


def search_server(label: str, banner: int) -> None:
    for i in range(banner):  # a start-up banner on stdout, before the SDK claims it
        print(f"{label} server starting, banner line {i}", flush=True)
    server = MCPServer(label, log_level="WARNING")

    @server.tool()
    def search(query: str) -> str:
        """Search this server's index."""
        return f"{label} found {query}"

    @server.tool()
    def chatter(lines: int) -> str:
        """Write `lines` lines of chatter onto stdout, then answer."""
        _wire_write(b"".join(f"progress {i}: not JSON-RPC at all\n".encode() for i in range(lines)))
        return f"{label} chattered {lines}"

    server.run()


def bad_server() -> None:
    server = MCPServer("bad", log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Return `text`."""
        return text

    @server.tool()
    def malformed(ctx: Context) -> str:
        """Answer with a result whose content is not a list."""
        _answer(ctx.request_id, b'{"content": "not a list", "isError": 7}')
        time.sleep(0.5)
        return "too late"

    @server.tool()
    def latin1(ctx: Context) -> str:
        """Answer with text that is not UTF-8."""
        _answer(
            ctx.request_id,
            b'{"resultType": "complete", "content": [{"type": "text", "text": "caf\xe9 cr\xe8me \xff"}], '
            b'"structuredContent": {"result": "caf\xe9"}}',
        )
        time.sleep(0.5)
        return "too late"

    @server.tool()
    def huge() -> str:
        """Three megabytes of text."""
        return "x" * 3_000_000

    @server.tool()
    def crash() -> str:
        """Exit mid-call."""
        os._exit(3)

    server.run()


def spawner_server() -> None:
    import subprocess

    server = MCPServer("spawner", log_level="WARNING")

    @server.tool()
    def spawn(how: str, seconds: int) -> str:
        """Start `sleep seconds` (how: child, setsid or orphan); its pid."""
        cmd = ["sleep", str(seconds)]
        if how == "orphan":  # a child that starts the sleep in a new session and exits at once
            r, w = os.pipe()
            if os.fork() == 0:
                os.setsid()
                pid = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).pid
                os.write(w, str(pid).encode())
                os._exit(0)
            os.close(w)
            return os.read(r, 32).decode()
        proc = subprocess.Popen(cmd, start_new_session=how == "setsid", stdout=subprocess.DEVNULL)
        return str(proc.pid)

    server.run()


if __name__ == "__main__":
    if sys.argv[1] == "search":
        search_server(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        {"bad": bad_server, "spawner": spawner_server}[sys.argv[1]]()
