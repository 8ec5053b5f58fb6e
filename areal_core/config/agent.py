"""The `agent` section: agent rollouts through the proxy and the MCP servers their tools come
from (docs/proxy.md, docs/agents.md)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from areal_core.config.base import Bool, ConfigModel, Float, Int, Invalid, Str


class MCPServerConfig(ConfigModel):
    """One MCP server an agent's tools come from (docs/agents.md): a command run as a subprocess
    speaking MCP over stdio, or the URL of a streamable-HTTP server."""

    name: Str = Field("", description="the server's name in episode outcomes and logs; empty: from the command or URL")
    command: Str = Field(
        "",
        description="stdio: the program to run (`python`: the rollout worker's own interpreter), from the project root",
    )
    args: list[Str] = Field(default_factory=list, description="stdio: its arguments")
    env: dict[Str, Str] = Field(default_factory=dict, description="stdio: extra environment variables")
    url: Str = Field("", description="streamable HTTP: the server's URL (http://host:port/mcp)")
    transport: Literal["stdio", "http"] = Field(
        "stdio",
        description=(
            "a command's transport: stdio (a process per episode unless stateless); http: started once per "
            "rollout worker on a free port (`{port}` in args), each episode its own session over streamable HTTP"
        ),
    )
    http_path: Str = Field("/mcp", description="transport http: the path of the server's MCP endpoint")
    stateless: Bool = Field(
        False,
        description=(
            "true: one session per rollout worker shared by every episode; "
            "false: each episode its own session (a fresh process for stdio)"
        ),
    )
    connect_timeout_s: Float = Field(
        0.0, ge=0, description="seconds to connect and list tools; 0: agent.mcp_connect_timeout_s"
    )
    call_timeout_s: Float = Field(0.0, ge=0, description="seconds per tool call; 0: agent.mcp_call_timeout_s")

    @model_validator(mode="after")
    def _one_transport(self) -> Self:
        if bool(self.command) == bool(self.url):
            raise Invalid("command", "or url: exactly one must be given")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise Invalid("url", f"must be an http(s) URL, got {self.url!r}")
        if (self.args or self.env) and not self.command:
            raise Invalid("args", "and env are for a command (stdio) server")
        if self.transport == "http":
            if not self.command:
                raise Invalid("transport", "http is for a command the worker starts; a url server is reached as it is")
            if "{port}" not in " ".join(self.args):
                raise Invalid("args", "of a transport: http server must hold {port} (the port it is started on)")
            if not self.http_path.startswith("/"):
                raise Invalid("http_path", f"must start with '/', got {self.http_path!r}")
        return self


class AgentConfig(ConfigModel):
    """Agent rollouts, used when rollout.agent is set (docs/proxy.md)."""

    max_concurrent_episodes: Int = Field(32, gt=0, description="agent episodes run at once per rollout worker")
    episode_timeout_s: Float = Field(300.0, gt=0, description="seconds before an episode is abandoned")
    turn_discount: Float = Field(1.0, ge=0, le=1, description="γ for per-turn rewards")
    tool_prompt: Literal["none", "names", "full"] = Field("none", description="how tools are announced to the model")
    corpus: Str = Field("", description="'pkg.module:fn' (records) -> texts: the tiny tokenizer's training text")
    sft_examples: Str = Field(
        "", description="'pkg.module:fn' (tokenizer, records) -> [(ids, loss_mask)]: warm-start episodes"
    )
    sft_fraction: Float = Field(
        1.0, ge=0, le=1, description="share of SFT records given as agent episodes; the rest as plain answers"
    )
    reward_min: Float = Field(
        -10.0,
        description=(
            "lowest reward accepted from outside (a proxy client, an agent's return value); online retraining drops "
            "rows outside [reward_min, reward_max] (docs/proxy.md)"
        ),
    )
    reward_max: Float = Field(10.0, description="highest reward accepted from outside (must be above reward_min)")
    mcp_servers: list[MCPServerConfig] = Field(
        default_factory=list,
        description=(
            "MCP servers whose tools the agent gets, each `{command, args, env}` (stdio) or `{url}` (streamable "
            "HTTP), with `name`, `stateless` (shared by all episodes), `connect_timeout_s`, `call_timeout_s` "
            "(docs/agents.md); the agent is then `run(task, base_url, api_key, tools)`"
        ),
    )
    mcp_max_calls: Int = Field(
        8, gt=0, description="tool calls per episode, all servers together; one more ends the episode"
    )
    mcp_connect_timeout_s: Float = Field(
        60.0, gt=0, description="seconds for an MCP server to start, connect and list its tools"
    )
    mcp_call_timeout_s: Float = Field(
        30.0, gt=0, description="seconds per MCP tool call; a slower server costs the episode"
    )
    mcp_max_result_chars: Int = Field(
        2000, gt=0, description="a tool result longer than this is cut, and the cut is said"
    )

    @model_validator(mode="after")
    def _reward_range(self) -> Self:
        if not -1e30 <= self.reward_min < self.reward_max <= 1e30:
            raise Invalid("reward_max", f"must be above reward_min ({self.reward_min:g}), both within ±1e30")
        return self

    @model_validator(mode="after")
    def _mcp_names(self) -> Self:
        names = [server_name(s) for s in self.mcp_servers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise Invalid("mcp_servers", f"names must differ, {dup} repeats (set `name`)")
        return self


def server_name(server: MCPServerConfig) -> str:
    """An MCP server's name: `name`; else the module after `-m`, the first `.py` argument or the
    command's base name (stdio); else the URL's host and port."""
    if server.name:
        return server.name
    if server.url:
        return server.url.split("://", 1)[1].split("/", 1)[0]
    args = list(server.args)
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    script = next((a for a in args if a.endswith(".py")), server.command)
    return script.rstrip("/").rsplit("/", 1)[-1].removesuffix(".py") or "server"
