"""The search agent's MCP server: `search(query)` and `read(doc_id)` over the seeded knowledge base.

    python -m examples.search_agent.server --seed 1 --people 1500          # stdio
    python -m examples.search_agent.server --seed 1 --people 1500 --http 8770

`search` returns up to `k` hits, one a line: `{doc id} {title}: {snippet}` (BM25 with `bm25s`,
examples/search_agent/kb.py); `read` returns a document's text. The server holds no state per
client, so a run declares it `stateless: true` and every episode of a rollout worker shares one.
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

from examples.search_agent.kb import KnowledgeBase, SearchEngine


def build(seed: int, people: int) -> MCPServer:
    engine = SearchEngine(KnowledgeBase.build(seed, people))
    server = MCPServer("search", log_level="WARNING")

    @server.tool()
    def search(query: str, k: int = 3) -> str:
        """Search the knowledge base; one hit a line: doc id, title, first sentence."""
        return engine.search(query, max(1, min(k, 10)))

    @server.tool()
    def read(doc_id: str) -> str:
        """The whole text of a document, by its id (e.g. d0042)."""
        return engine.read(doc_id)

    return server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--people", type=int, default=1500)
    ap.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port (0: stdio)")
    a = ap.parse_args()
    server = build(a.seed, a.people)
    if a.http:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
