"""The tool loop every MCP example agent runs: ask the model, run its tool calls, repeat.

    result = await tool_loop(messages, base_url, api_key, tools, max_turns=6)
    result.final     # the model's last answer ("" when it never gave one)
    result.stopped   # "answer", "budget" (tools.exhausted), "turns", "context" (the proxy refused: too long)

Written with the plain `openai` SDK against the proxy, like any user's agent: the tools reach the
model as the request's `tools` (the proxy renders them in the model's chat template, or not at
all with `agent.tool_prompt: none`), its `<tool_call>` blocks come back as OpenAI `tool_calls`,
each is run through `tools.call` (MCP) and its result goes back as a `role: "tool"` message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_core.agents.tools import EpisodeTools


@dataclass
class LoopResult:
    final: str
    messages: list[Any] = field(default_factory=list)
    turns: int = 0
    stopped: str = "answer"


async def tool_loop(
    messages: list[dict[str, Any]],
    base_url: str,
    api_key: str,
    tools: EpisodeTools | None,
    *,
    max_turns: int = 8,
    model: str = "areal-policy",
) -> LoopResult:
    """Up to `max_turns` model turns; a turn with tool calls runs them all, one without ends the loop.
    `tools` None (the agent was run without `agent.mcp_servers`) is a RuntimeError saying so."""
    if tools is None:
        raise RuntimeError("this agent needs MCP tools: run it with agent.mcp_servers set (docs/agents.md)")
    from openai import AsyncOpenAI, BadRequestError

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    out = LoopResult("", list(messages), stopped="turns")
    try:
        for _ in range(max_turns):
            try:
                resp = await client.chat.completions.create(
                    model=model, messages=out.messages, tools=tools.specs or None
                )
            except BadRequestError:  # the episode outgrew the context
                out.stopped = "context"
                break
            out.turns += 1
            msg = resp.choices[0].message
            out.messages.append(msg)
            if not msg.tool_calls:
                out.final, out.stopped = msg.content or "", "answer"
                break
            for call in msg.tool_calls:
                text = await tools.call(call.function.name, call.function.arguments)
                out.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
            if tools.exhausted:
                out.stopped = "budget"
                break
    finally:
        await client.close()
    return out
