"""A small third-party-style MCP server: arithmetic and a notebook that remembers within a session.

    python -m examples.toy_mcp.server                  # stdio (what `agent.mcp_servers: [{command: ...}]` runs)
    python -m examples.toy_mcp.server --http 8765      # streamable HTTP at http://127.0.0.1:8765/mcp

Written with the `mcp` SDK's `MCPServer` and nothing of this project, as a user's server would be.
The notebook lives in the process: a stdio server started per episode forgets it between episodes,
one declared `stateless: true` (shared) does not.
"""

from __future__ import annotations

import argparse
import asyncio

from mcp.server.mcpserver import MCPServer

server = MCPServer("toy", log_level="WARNING")
NOTES: list[str] = []


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def write_note(text: str) -> str:
    """Write a note in the notebook; returns how many notes it holds."""
    NOTES.append(text)
    return f"{len(NOTES)} notes"


@server.tool()
def read_notes() -> str:
    """Every note written so far, one a line ('(empty)' when none)."""
    return "\n".join(NOTES) or "(empty)"


@server.tool()
async def wait(seconds: float) -> str:
    """Wait `seconds`, then say so."""
    await asyncio.sleep(seconds)
    return f"waited {seconds:g} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port (0: stdio)")
    a = ap.parse_args()
    if a.http:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
