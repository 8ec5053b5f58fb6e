"""OpenAI-compatible agent proxy: server, sessions, incremental chat templating, agent workflows."""
