"""An episode's tool names over its MCP servers: `server.tool`, and the collisions refused.

One server (every config and example of this project): its tools keep their own names in the
specs, what the warm-start episodes and the model use, and `server.tool` reaches them too. Several
servers: every tool is `server.tool` in the specs, `server` the name the config gives the server
(`agent.mcp_servers[].name`, else from its command or URL: `config/run.py:server_name`), so two
servers' `search` are `a.search` and `b.search`, each reaching its own server. A bare name that one
server alone has still reaches it; one that several have reaches none, and the model is told which
to call. Names are matched whole, never split at the dot, so a server name may hold dots.

Refused, naming both (`ToolNameCollision`): two servers of one name (`check_servers`, when the
environment is made and again at connect), two tools whose qualified names meet (server `a.b` tool
`c` and server `a` tool `b.c`), a name over the proxy's 128 characters (`tool_routes`, at connect).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_core.agents.mcp import openai_tool

SEP = "."
MAX_NAME = 128  # the proxy's limit on a function name (proxy/schemas.py)


class ToolNameCollision(ValueError):
    """Two servers, or two tools, that one name would reach: a configuration to fix, not a server's fault."""


def check_servers(names: Iterable[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ToolNameCollision(
                f"two MCP servers are named {name!r}: their tools and sessions would be one; give each a "
                "distinct `name` in agent.mcp_servers"
            )
        seen.add(name)


@dataclass
class Routes:
    """The specs the model sees, and what each name it may call reaches."""

    specs: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, tuple[Any, str]] = field(default_factory=dict)  # name -> (connection, the server's tool name)
    ambiguous: dict[str, list[str]] = field(default_factory=dict)  # bare name on several servers -> their names


def tool_routes(conns: Sequence[Any]) -> Routes:
    """The routes of connections (each with `.spec.name` and `.tools`), or ToolNameCollision."""
    check_servers(c.spec.name for c in conns)
    qualify = len(conns) > 1
    out, owner = Routes(), {}
    for conn in conns:
        for tool in conn.tools:
            full = f"{conn.spec.name}{SEP}{tool.name}"
            if full in owner:
                (server, other) = owner[full]
                raise ToolNameCollision(
                    f"MCP tool name {full!r} is ambiguous: server {server!r} tool {other!r} and server "
                    f"{conn.spec.name!r} tool {tool.name!r}; give the servers names that do not meet "
                    "(agent.mcp_servers[].name)"
                )
            if qualify and len(full) > MAX_NAME:
                raise ToolNameCollision(
                    f"MCP tool name {full!r} (server {conn.spec.name!r}, tool {tool.name!r}) is over the proxy's "
                    f"{MAX_NAME} characters: give the server a shorter `name` in agent.mcp_servers"
                )
            owner[full] = (conn.spec.name, tool.name)
            exposed = full if qualify else tool.name
            out.routes[exposed] = (conn, tool.name)
            out.specs.append(openai_tool(tool, exposed))
    bare: dict[str, list[str]] = {}
    for full, (_server, tool) in owner.items():
        bare.setdefault(tool, []).append(full)
    for name, fulls in bare.items():  # the other spelling reaches a tool too, never over an exposed name
        if not qualify:
            out.routes.setdefault(fulls[0], out.routes[name])
        elif len(fulls) == 1:
            out.routes.setdefault(name, out.routes[fulls[0]])
        elif name not in out.routes:
            out.ambiguous[name] = fulls
    return out
