"""Example agents and the MCP servers they use (each folder has a README)."""
