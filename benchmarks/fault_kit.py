"""What the fault benchmark (benchmarks/faults.py) and the tests that inject the same faults share:
a TCP forwarder that can cut a server off, a damaged published version, a scripted MCP agent
and the processes a hostile tool left behind. Benchmarks import this, never the test suite."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

from areal_core.layout import LAYOUT
from areal_core.procs import free_port
from areal_core.store import Store


def flip_byte(store: Store, version: int) -> None:
    """Flip one byte of the weights (or delta) file of `version`, leaving its manifest as it was."""
    from areal_core.weights import DELTA_FILE, WEIGHTS_FILE

    name = DELTA_FILE if store.exists(LAYOUT.weights_file(version, DELTA_FILE)) else WEIGHTS_FILE
    blob = bytearray(store.read_bytes(LAYOUT.weights_file(version, name)))
    blob[len(blob) // 2] ^= 0xFF
    store.write_bytes(LAYOUT.weights_file(version, name), bytes(blob))


class Forwarder:
    """A TCP forwarder on 127.0.0.1 in front of `target_port` (the moto server, which keeps its
    state in memory and is never stopped). `down()` closes the listening socket and cuts every
    open connection, so clients get connection refused/reset; `up()` listens on the same port again."""

    def __init__(self, target_port: int):
        import threading

        self.target, self.port = ("127.0.0.1", target_port), free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server: socket.socket | None = None
        self._closed = False
        self.up()
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        with self._lock:
            self._server = s

    def down(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, set()
        if server is not None:
            server.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def outage(self, seconds: float) -> None:
        self.down()
        time.sleep(seconds)
        self.up()

    def close(self) -> None:
        self._closed = True
        self.down()

    def _accept_loop(self) -> None:
        import select
        import threading

        while not self._closed:
            server = self._server
            if server is None:
                time.sleep(0.02)
                continue
            try:
                if not select.select([server], [], [], 0.1)[0]:
                    continue
                client, _ = server.accept()
            except (OSError, ValueError):  # closed by down() meanwhile
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._conns -= {src, dst}
        src.close()


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=10)
            return
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not come up in {timeout_s}s")


SEEN: dict[str, dict] = {}  # prompt_id -> what the agent saw


def scripted_reply(prompt_text: str) -> str:
    """Make the calls the user's message lists (`CALL name {json}` lines) in order, one a turn,
    then answer `#### <the last tool result>`."""
    last_user = prompt_text.rsplit("<|im_start|>user\n", 1)[-1]
    calls = re.findall(r"^CALL (\S+) (.*)$", last_user.split("<|im_end|>")[0], re.M)
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", last_user, re.DOTALL)
    if len(results) < len(calls):
        name, args = calls[len(results)]
        return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
    return f"#### {results[-1] if results else ''}"


async def scripted_agent(task, base_url, api_key, tools):
    from areal_core.agents.loop import tool_loop

    result = await tool_loop([{"role": "user", "content": task["prompt"]}], base_url, api_key, tools)
    SEEN[task["prompt_id"]] = {"result": result, "tools": tools}
    return 1.0 if result.final == f"#### {task['answer']}" else 0.0


def mcp_task(pid: str, calls: list[tuple[str, dict]], answer: str = "") -> dict:
    """A task whose user message lists the calls `scripted_reply` makes, one a turn."""
    lines = [f"CALL {name} {json.dumps(args)}" for name, args in calls]
    return {"prompt_id": pid, "prompt": "\n".join(["Use the tools.", *lines]), "answer": answer, "meta": {}}


def mcp_episodes(tok, servers, tasks, tool_prompt="none", **kw):
    """One episode per task through MCPWorkflow (one event loop); (results, workflow stats)."""
    from areal_core.agents.tools import MCPEnvironment  # the agents' stack, only where episodes run
    from areal_core.agents.workflow import MCPWorkflow
    from areal_core.proxy.examples import ScriptedEngine

    env = MCPEnvironment(servers, **kw)
    workflow = MCPWorkflow(tok, scripted_agent, mcp=env, group_size=1, tool_prompt=tool_prompt)
    engine = ScriptedEngine(tok, scripted_reply)

    async def main():
        try:
            return [await workflow.run_episode(engine, t) for t in tasks]
        finally:
            await env.aclose()

    try:
        results = asyncio.run(main())
    finally:
        workflow.close()
    return results, workflow.stats()


def sleeping_pids(seconds: int) -> list[int]:
    """Pids of the live (not zombie) `sleep <seconds>` processes."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:2]
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if argv == [b"sleep", str(seconds).encode()] and not zombie:
            out.append(int(entry))
    return out
