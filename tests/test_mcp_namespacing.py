"""Issue 46: several MCP servers in one episode, and servers that write chatter on stdout. Real
stdio servers written with the `mcp` SDK (`tests/test_mcp_servers.py search LABEL`), the real proxy,
a scripted policy (the helpers of tests/test_mcp.py).

A server's stdout lines that are not JSON-RPC are counted per server (`mcp.noise_lines`) and logged
once, without the SDK's traceback per line; two servers' tools of one name are `a.search` and
`b.search`, each reaching its own server; two servers of one name, and qualified names that meet,
are refused with both named."""

from __future__ import annotations

import asyncio
import io
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from areal_core.agents.mcp import ServerSpec
from areal_core.agents.mcp_names import ToolNameCollision, tool_routes
from areal_core.agents.tools import MCPEnvironment
from tests import test_mcp
from tests.test_mcp import SEEN, run, task, told

one_torch_thread, tok = test_mcp.one_torch_thread, test_mcp.tok  # the same fixtures

SERVERS = "tests/test_mcp_servers.py"


def search_server(label: str, banner: int = 0, name: str = "") -> ServerSpec:
    """The test server `label`: `search` answers `<label> found <query>`; `chatter(lines)` writes
    lines that are not JSON-RPC; `banner` such lines printed at start. Limits no busy machine reaches."""
    args = (SERVERS, "search", label, str(banner))
    return ServerSpec(name or label, command="python", args=args, connect_timeout_s=300, call_timeout_s=300)


def test_stdout_chatter_is_counted_per_server_and_logged_once_without_a_traceback(tok):
    """10,000 lines of chatter during a call and a 3-line banner at start: the episode works, the
    count is exact (per server in the stats, per episode on its tools), the log is a few lines."""
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        calls = [("chatter", {"lines": 10_000}), ("search", {"query": "cats"})]
        (r,), stats = run(tok, [search_server("noisy", banner=3)], [task("chatty", calls, "noisy found cats")])
    finally:
        root.removeHandler(handler)
    assert r.error is None and r.reward == 1.0
    assert told("chatty") == ["noisy chattered 10000", "noisy found cats"]
    assert stats["mcp"]["noise_lines"] == {"noisy": 10_003}
    assert SEEN["chatty"]["tools"].noise_lines == {"noisy": 10_003}
    log = sink.getvalue()
    assert "Traceback" not in log and len(log.encode()) < 20_000, log[:2000]
    assert "MCP server 'noisy' wrote a line to stdout that is not JSON-RPC" in log  # the first one, said once
    assert "Failed to parse JSONRPC message" not in log  # the SDK's record of each line, dropped


def test_two_servers_tools_of_one_name_are_namespaced_and_reach_their_own_server(tok):
    """`a.search` and `b.search` each reach their server; the bare `search`, on both, is refused
    naming both (an unknown tool: the episode goes on)."""
    calls = [("a.search", {"query": "x"}), ("b.search", {"query": "y"}), ("search", {"query": "z"})]
    calls.append(("a.search", {"query": "w"}))
    (r,), stats = run(tok, [search_server("a"), search_server("b")], [task("two", calls, "a found w")])
    assert r.error is None and r.reward == 1.0
    assert SEEN["two"]["tools"].names == ["a.search", "a.chatter", "b.search", "b.chatter"]
    said = told("two")
    assert said[:2] == ["a found x", "b found y"] and said[3] == "a found w"
    assert said[2] == "error: tool 'search' is on several servers: call a.search or b.search"
    assert [c.server for c in SEEN["two"]["tools"].calls] == ["a", "b", "", "a"]
    assert stats["mcp"]["events"] == {"unknown_tool": 1} and stats["mcp"]["outcomes"] == {"ok": 1}


def test_one_server_keeps_its_bare_names_and_answers_the_qualified_ones_too(tok):
    """One server (every config and example of the project): the specs keep the tools' own names,
    and `server.tool` reaches the same tool."""
    calls = [("search", {"query": "x"}), ("solo.search", {"query": "y"})]
    (r,), _ = run(tok, [search_server("solo")], [task("one", calls, "solo found y")])
    assert r.error is None and r.reward == 1.0
    assert SEEN["one"]["tools"].names == ["search", "chatter"]
    assert told("one") == ["solo found x", "solo found y"]


def test_two_servers_of_one_name_are_refused_naming_it():
    """Before anything starts: no server process, a message naming the server and what to do."""
    with pytest.raises(ToolNameCollision, match=r"two MCP servers are named 'a'.*give each a distinct `name`"):
        MCPEnvironment([search_server("a"), search_server("b", name="a")])


def test_two_servers_configured_with_one_name_are_refused_at_connect_naming_it():
    """The same refusal when the environment's servers are set after it was made, at connect."""
    env = MCPEnvironment([search_server("a")])
    env.servers.append(search_server("b", name="a"))

    async def main() -> None:
        async with env.episode():
            pass

    with pytest.raises(ToolNameCollision, match=r"two MCP servers are named 'a'"):
        asyncio.run(main())
    assert env.outcomes == {"tool_name_collision": 1}


@dataclass
class _Tool:
    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Conn:
    spec: ServerSpec
    tools: list[_Tool]


def test_qualified_names_that_meet_are_refused_naming_both_servers_and_tools():
    """Server `p.q` tool `search` and server `p` tool `q.search` are both `p.q.search`: refused."""
    conns = [_Conn(ServerSpec("p.q"), [_Tool("search")]), _Conn(ServerSpec("p"), [_Tool("q.search")])]
    with pytest.raises(ToolNameCollision) as err:
        tool_routes(conns)
    assert str(err.value) == (
        "MCP tool name 'p.q.search' is ambiguous: server 'p.q' tool 'search' and server 'p' tool 'q.search'; "
        "give the servers names that do not meet (agent.mcp_servers[].name)"
    )
    long = [_Conn(ServerSpec("s" * 100), [_Tool("t" * 40)]), _Conn(ServerSpec("b"), [_Tool("t")])]
    with pytest.raises(ToolNameCollision, match=r"over the proxy's 128 characters"):
        tool_routes(long)


def test_a_bare_name_one_server_alone_has_reaches_it_and_exposed_names_win():
    """Several servers: the specs are qualified; `fetch` (on `a` only) reaches `a`, `search` (on
    both) nothing; one server: its own names, the qualified spelling as well."""
    a, b = _Conn(ServerSpec("a"), [_Tool("search"), _Tool("fetch")]), _Conn(ServerSpec("b"), [_Tool("search")])
    named = tool_routes([a, b])
    assert [s["function"]["name"] for s in named.specs] == ["a.search", "a.fetch", "b.search"]
    assert named.routes["fetch"] == (a, "fetch") and named.routes["b.search"] == (b, "search")
    assert "search" not in named.routes and named.ambiguous == {"search": ["a.search", "b.search"]}
    one = tool_routes([a])
    assert [s["function"]["name"] for s in one.specs] == ["search", "fetch"]
    assert one.routes["a.fetch"] == one.routes["fetch"] == (a, "fetch") and not one.ambiguous
