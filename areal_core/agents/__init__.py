"""Agent environments: MCP servers as the tools of agent episodes (docs/agents.md)."""
