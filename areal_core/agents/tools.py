"""An episode's tools from MCP servers: isolation, the call budget, outcomes and their counts.

    env = MCPEnvironment([ServerSpec("search", command="python", args=("-m", "pkg.server"))], max_calls=8)
    async with env.episode() as tools:        # connected, tools listed
        tools.specs                           # OpenAI function specs: pass as `tools=` to the proxy
        text = await tools.call("search", '{"query": "..."}')   # the tool message's content

Tool names: one server's tools keep their own (`server.tool` reaches them too); with several servers
each is `server.tool`, and two servers of one name or qualified names that meet are refused
(`ToolNameCollision`, `mcp_names.py`). A stdio server's stdout lines that are not JSON-RPC are
counted per server (`stats()["noise_lines"]`, `tools.noise_lines` for the episode), not logged each.

Each episode gets its own session of every server (a fresh process for a stdio server, a fresh
client session for a URL or a `transport: http` command, whose one process `served.ServedProcess`
starts and restarts), opened concurrently and closed when the episode ends, so nothing one episode
did is visible to the next. A server declared `stateless` is connected once per event loop and
shared by every episode on it (reconnected after it fails). `close()` stops the started processes.

What the model does wrong is told to it in the tool message and counted as an event, and the
episode goes on: `unknown_tool`, `bad_arguments` (not JSON, not an object, missing or mistyped
against the tool's input schema: never sent), `tool_error` (the server's own error), `result_cut`,
`result_not_utf8`. The call past `max_calls` is not made: `budget_exceeded`, `tools.exhausted` is
set and the agent's loop ends the episode. What a server does wrong costs the episode:
`ServerFailure` (`connect_failed`, `connect_timeout`, `call_timeout`, `server_crashed`,
`protocol_error`, each with the server's name) is raised from `call` or from `episode()`, and is
raised again when the episode ends even if the agent caught it, so its rows are dropped. A tool
name that two servers would share costs the episode too (`tool_name_collision`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from areal_core.agents.mcp import (
    Connection,
    ServerFailure,
    ServerSpec,
    argument_problem,
    parse_arguments,
    result_text,
)
from areal_core.agents.mcp_names import ToolNameCollision, check_servers, tool_routes
from areal_core.agents.served import ServedProcess


@dataclass
class ToolCall:
    """One call an episode made: what the model asked, what it was told."""

    name: str
    arguments: dict[str, Any] | None
    text: str
    server: str = ""
    event: str = ""  # the call's first event ("" for a plain success)


@dataclass
class EpisodeTools:
    """The tools of one episode (see the module doc)."""

    specs: list[dict[str, Any]]
    routes: dict[str, tuple[Connection, str]]  # a name that reaches a tool -> (connection, the server's tool name)
    max_calls: int
    max_result_chars: int
    ambiguous: dict[str, list[str]] = field(default_factory=dict)  # bare name on several servers -> theirs
    connections: list[Connection] = field(default_factory=list)
    noise_base: dict[str, int] = field(default_factory=dict)  # a shared connection's noise_lines before the episode
    calls: list[ToolCall] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    exhausted: bool = False
    failure: ServerFailure | None = None

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.specs]

    @property
    def noise_lines(self) -> dict[str, int]:
        """Per server, its stdout lines that were not JSON-RPC in this episode, its connect included
        (a shared session's: since the episode began); a server with none is absent."""
        out = {c.spec.name: c.noise_lines - self.noise_base.get(c.spec.name, 0) for c in self.connections}
        return {name: n for name, n in out.items() if n}

    def _told(self, name: str, args: dict[str, Any] | None, event: str, text: str, server: str = "") -> str:
        if event:
            self.events[event] += 1
        self.calls.append(ToolCall(name, args, text, server, event))
        return text

    async def call(self, name: str, arguments: Any) -> str:
        """Run the model's call `name(arguments)`; the text for its tool message."""
        if self.failure is not None:
            raise self.failure
        if len([c for c in self.calls if c.event != "budget_exceeded"]) >= self.max_calls:
            self.exhausted = True
            return self._told(
                name, None, "budget_exceeded", f"error: the budget of {self.max_calls} tool calls is used"
            )
        route = self.routes.get(name)
        if route is None:
            if name in self.ambiguous:
                text = f"error: tool {name!r} is on several servers: call {' or '.join(self.ambiguous[name])}"
                return self._told(name, None, "unknown_tool", text)
            known = ", ".join(self.names) or "none"
            return self._told(name, None, "unknown_tool", f"error: unknown tool {str(name)[:60]!r}; tools: {known}")
        conn, tool = route
        args, problem = parse_arguments(arguments)
        if args is not None:
            schema = next((t.input_schema for t in conn.tools if t.name == tool), None)
            problem = argument_problem(schema if isinstance(schema, dict) else {}, args)
        if problem:
            return self._told(name, args, "bad_arguments", f"error: {problem}", conn.spec.name)
        try:
            result = await conn.call(tool, args or {})
        except ServerFailure as exc:
            self.failure = exc
            raise
        text, events = result_text(result, self.max_result_chars)
        for e in events[1:]:
            self.events[e] += 1
        return self._told(name, args, events[0] if events else "", text, conn.spec.name)


class MCPEnvironment:
    """MCP servers as an agent's environment; counts episode outcomes and tool-call events."""

    def __init__(self, servers: Sequence[ServerSpec], max_calls: int = 8, max_result_chars: int = 2000):
        self.servers = list(servers)
        check_servers(s.name for s in self.servers)  # ToolNameCollision: two servers of one name
        self.max_calls, self.max_result_chars = max_calls, max_result_chars
        self.outcomes: Counter = Counter()  # per episode: ok, budget_exceeded, {kind}:{server}, agent_error, ...
        self.events: Counter = Counter()  # per tool call, all episodes
        self.tool_calls = 0
        self.noise: Counter = Counter()  # server name -> its stdout lines that were not JSON-RPC
        self._shared: dict[Any, dict[str, Connection]] = {}  # event loop -> server name -> connection
        self._locks: dict[Any, asyncio.Lock] = {}
        self.served = {s.name: ServedProcess(s) for s in self.servers if s.transport == "http" and not s.url}

    @property
    def mcp_servers(self) -> list[ServerSpec]:
        """The servers (the name the run's `agent` section gives them: either selects MCPWorkflow)."""
        return self.servers

    @classmethod
    def from_config(cls, agent: Any) -> MCPEnvironment:
        """From the run's `agent` section (`agent.mcp_servers`, `agent.mcp_*`)."""
        specs = [
            ServerSpec.from_config(s, agent.mcp_connect_timeout_s, agent.mcp_call_timeout_s) for s in agent.mcp_servers
        ]
        return cls(specs, agent.mcp_max_calls, agent.mcp_max_result_chars)

    async def _shared_connection(self, spec: ServerSpec) -> Connection:
        if spec.name in self.served:
            spec = await self.served[spec.name].url_spec()
        loop = asyncio.get_running_loop()
        for dead in [k for k in self._shared if k is not loop and k.is_closed()]:
            self._shared.pop(dead, None)
            self._locks.pop(dead, None)
        async with self._locks.setdefault(loop, asyncio.Lock()):
            conns = self._shared.setdefault(loop, {})
            conn = conns.get(spec.name)
            if conn is None or not conn.alive or conn.spec.url != spec.url:  # a restarted server: its new port
                conn = Connection(spec, noise_sink=self.noise)
                conns[spec.name] = conn
                await conn.open()
            return conn

    async def _open(self, spec: ServerSpec) -> Connection:
        if spec.stateless:
            return await self._shared_connection(spec)
        if spec.name in self.served:
            spec = await self.served[spec.name].url_spec()
        conn = Connection(spec, noise_sink=self.noise)
        await conn.open()
        return conn

    @asynccontextmanager
    async def episode(self) -> AsyncIterator[EpisodeTools]:
        """The episode's tools; the outcome is counted when it ends (see the module doc)."""
        try:
            check_servers(s.name for s in self.servers)
        except ToolNameCollision:
            self.outcomes["tool_name_collision"] += 1
            raise
        opened = await asyncio.gather(*(self._open(s) for s in self.servers), return_exceptions=True)
        own = [c for c, s in zip(opened, self.servers) if isinstance(c, Connection) and not s.stateless]
        failure = next((c for c in opened if isinstance(c, BaseException)), None)
        tools: EpisodeTools | None = None
        try:
            if failure is not None:
                outcome = failure.outcome if isinstance(failure, ServerFailure) else "connect_failed"
                self.outcomes[outcome] += 1
                raise failure
            try:
                named = tool_routes(opened)
            except ToolNameCollision:
                self.outcomes["tool_name_collision"] += 1
                raise
            shared = [c for c, s in zip(opened, self.servers) if s.stateless]
            base = {c.spec.name: c.noise_lines for c in shared}  # a shared session's lines before this episode
            tools = EpisodeTools(
                named.specs, named.routes, self.max_calls, self.max_result_chars, named.ambiguous, list(opened), base
            )
            try:
                yield tools
            except ServerFailure as exc:
                self.outcomes[exc.outcome] += 1
                raise
            except asyncio.CancelledError:
                self.outcomes["episode_timeout"] += 1
                raise
            except Exception:
                self.outcomes[tools.failure.outcome if tools.failure else "agent_error"] += 1
                raise
            if tools.failure is not None:  # the agent caught it: the episode still goes
                self.outcomes[tools.failure.outcome] += 1
                raise tools.failure
            self.outcomes["budget_exceeded" if tools.exhausted else "ok"] += 1
        finally:
            if tools is not None:
                self.tool_calls += len(tools.calls)
                self.events.update(tools.events)
            await asyncio.gather(*(c.close() for c in own), return_exceptions=True)

    async def aclose(self) -> None:
        """Close the shared connections of the running loop (those of a closed loop ended with it)."""
        conns = self._shared.pop(asyncio.get_running_loop(), {})
        await asyncio.gather(*(c.close() for c in conns.values()), return_exceptions=True)

    def close(self) -> None:
        """Stop the processes of `transport: http` servers (a later episode starts them again)."""
        for served in self.served.values():
            served.stop()

    def stats(self) -> dict[str, Any]:
        out = {"outcomes": dict(self.outcomes), "events": dict(self.events), "tool_calls": self.tool_calls}
        if self.noise:  # per server, its stdout lines that were not JSON-RPC (docs/agents.md)
            out["noise_lines"] = dict(self.noise)
        if self.served:  # a count that grows means the server keeps dying (each start costs its episodes)
            out["server_starts"] = {name: served.starts for name, served in self.served.items()}
        return out
