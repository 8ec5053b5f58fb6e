"""The agent workflow with MCP tools: `AgentWorkflow` whose episodes each get their `EpisodeTools`.

A run whose config lists `agent.mcp_servers` runs this workflow (the rollout worker, through
`proxy/agent_workflow.py:from_context`); its agent is

    async def run(task: dict, base_url: str, api_key: str, tools: EpisodeTools) -> float | None

Each episode is the agent against the in-process proxy (as for any agent) with its own session
of every MCP server; a server failure drops the episode (its rows never reach the trainer) and is
counted by name in the worker's heartbeat (`stats()["mcp"]["outcomes"]`), next to the events of
the model's tool calls. `evaluate_agent(..., mcp=cfg.agent)` is the held-out success rate.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from areal_core.agents.tools import EpisodeTools, MCPEnvironment
from areal_core.config.hooks import import_object
from areal_core.proxy.agent_workflow import AgentWorkflow

MCPAgentFn = Callable[[dict[str, Any], str, str, EpisodeTools], Awaitable[float | None]]


def with_tools(agent: MCPAgentFn, environment: MCPEnvironment) -> Callable[..., Awaitable[float | None]]:
    """`agent` as a plain `run(task, base_url, api_key)`: each call opens its episode's tools."""

    @functools.wraps(agent)
    async def run(task: dict[str, Any], base_url: str, api_key: str) -> float | None:
        async with environment.episode() as tools:
            return await agent(task, base_url, api_key, tools)

    return run


class MCPWorkflow(AgentWorkflow):
    """`AgentWorkflow` over an agent that takes MCP tools.

    mcp: an `MCPEnvironment`, or the run's `agent` config section (`agent.mcp_servers`, `agent.mcp_*`).
    """

    def __init__(self, tokenizer: Any, agent: MCPAgentFn | str, *, mcp: Any, **kw: Any):
        fn = import_object(agent, key="rollout.agent", coroutine=True) if isinstance(agent, str) else agent
        self.environment = mcp if isinstance(mcp, MCPEnvironment) else MCPEnvironment.from_config(mcp)
        super().__init__(tokenizer, with_tools(fn, self.environment), **kw)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "mcp": self.environment.stats()}

    def close(self) -> None:
        super().close()
        self.environment.close()
