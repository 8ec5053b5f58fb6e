"""One connection to an MCP server, and what passes through it: tool specs, arguments, results.

`Connection(spec)` opens an MCP client session (the `mcp` SDK's `Client`) on a task of its own:
a stdio server is started as a subprocess (its stderr kept in a file, quoted when it fails), a
URL server is reached over streamable HTTP. Whatever the server does, hang, crash, write
malformed JSON-RPC or non-UTF-8 bytes, ends inside that task; a caller sees `ServerFailure`
with a kind (`connect_failed`, `connect_timeout`, `call_timeout`, `server_crashed`,
`protocol_error`) and the server's name, and never a cancellation or an exception group of the
SDK's. Every wait is bounded (`connect_timeout_s`, `call_timeout_s`); closing kills a stdio
server's process tree (the SDK's shutdown) within a bounded time. A stdio server runs under a
subreaper (`mcp_reaper.py`) that kills every process its tools started when the server ends, those
started after setsid or orphaned by a double fork included. A stdio server's stdout lines that are
not JSON-RPC are counted (`noise_lines`, and the environment's count per server), not logged each
with the SDK's traceback (`mcp_noise.py`).

`openai_tool` gives an MCP tool as an OpenAI function spec (what the proxy's templating renders),
`argument_problem` checks a model's arguments against the tool's input schema (types of the
top-level properties, required ones) before anything is sent, and `result_text` renders a
`CallToolResult` as the tool message: text parts joined, other parts named, cut at a length with
the cut said, non-UTF-8 replaced and said.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_core.agents import mcp_noise

PROJECT_ROOT = Path(__file__).resolve().parents[2]
REAPER = Path(__file__).with_name("mcp_reaper.py")
LIST_PAGES = 20  # tools/list pages read at most: a paginator that never ends cannot hang a connect
MAX_TOOLS = 128  # tools of one server (the proxy's max_tools): each one is rendered into every prompt
MAX_SCHEMA_CHARS = 65_536  # one tool's name, description and input schema as JSON
CLOSE_S = 10.0  # bound on closing one connection (the SDK's own shutdown waits ~2 s, then kills)
STDERR_TAIL = 300
logging.getLogger("mcp.client.streamable_http").setLevel(logging.WARNING)  # no line per episode's session id
mcp_noise.install()  # a stdio server's stdout chatter: counted, not a traceback a line


@dataclass(frozen=True)
class ServerSpec:
    """Where a server is and how long to wait for it (from `agent.mcp_servers`, docs/agents.md)."""

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    stateless: bool = False
    transport: str = "stdio"  # a command's: stdio (a process per session) or http (one process, sessions over HTTP)
    http_path: str = "/mcp"
    connect_timeout_s: float = 60.0
    call_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, server: Any, connect_timeout_s: float = 60.0, call_timeout_s: float = 30.0) -> ServerSpec:
        """An `MCPServerConfig` (or a dict of the same keys) as a spec; its 0 timeouts take the defaults."""
        from areal_core.config.agent import MCPServerConfig, server_name

        cfg = server if isinstance(server, MCPServerConfig) else MCPServerConfig.model_validate(server)
        return cls(
            name=server_name(cfg),
            command=cfg.command,
            args=tuple(cfg.args),
            env=tuple(sorted(cfg.env.items())),
            url=cfg.url,
            stateless=cfg.stateless,
            transport=cfg.transport,
            http_path=cfg.http_path,
            connect_timeout_s=cfg.connect_timeout_s or connect_timeout_s,
            call_timeout_s=cfg.call_timeout_s or call_timeout_s,
        )

    def executable(self) -> str:
        """`python`/`python3` is this interpreter (the rollout worker's venv); a relative path is from the root."""
        if self.command in ("python", "python3"):
            return sys.executable
        if "/" in self.command and not os.path.isabs(self.command):
            return str(PROJECT_ROOT / self.command)
        return self.command


class ServerFailure(Exception):
    """A server that failed, hung or broke the protocol: the episode using it is dropped and counted
    under `outcome` (`{kind}:{server}`)."""

    def __init__(self, server: str, kind: str, detail: str):
        super().__init__(f"MCP server {server!r}: {kind}: {detail}")
        self.server, self.kind, self.detail = server, kind, detail

    @property
    def outcome(self) -> str:
        return f"{self.kind}:{self.server}"


def _describe(exc: BaseException) -> str:
    """The first leaf of an exception (group) in one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Connection:
    """An MCP client session owned by its own task; `open()` returns the server's tools."""

    spec: ServerSpec
    tools: list[Any] = field(default_factory=list)
    client: Any = None
    failure: ServerFailure | None = None
    noise_lines: int = 0  # stdout lines of a stdio server that were not JSON-RPC
    noise_sink: Counter | None = None  # the environment's count of them per server name
    _task: asyncio.Task | None = None
    _ready: asyncio.Future | None = None
    _stop: asyncio.Event | None = None
    _stderr: Any = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.failure is None

    async def open(self) -> list[Any]:
        loop = asyncio.get_running_loop()
        self._ready, self._stop = loop.create_future(), asyncio.Event()
        self._task = asyncio.create_task(self._main(), name=f"mcp-{self.spec.name}")
        done, _ = await asyncio.wait(
            {self._ready, self._task}, timeout=self.spec.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if self._ready in done and not self._ready.exception():
            return self.tools
        if not done:
            await self.close()
            raise self._fail("connect_timeout", f"no tool list within {self.spec.connect_timeout_s:g} s{self._tail()}")
        await self.close()
        raise self.failure or self._fail("connect_failed", f"the session ended before listing tools{self._tail()}")

    def _transport(self) -> Any:
        if self.spec.url:
            return self.spec.url
        from mcp.client.stdio import StdioServerParameters, stdio_client

        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
        env.update(dict(self.spec.env))
        # under the reaper (mcp_reaper.py): what the server's tools start dies with it
        params = StdioServerParameters(
            command=sys.executable,
            args=[str(REAPER), self.spec.executable(), *self.spec.args],
            env=env,
            cwd=str(PROJECT_ROOT),
            encoding_error_handler="replace",  # non-UTF-8 bytes become U+FFFD, and the result says so
        )
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="areal-mcp-")
        return stdio_client(params, errlog=self._stderr)

    async def _main(self) -> None:
        from mcp import Client

        mcp_noise.OURS.set(True)  # this task's, inherited by the SDK's stdout reader: no traceback per noise line
        try:
            # a server the worker started (transport http) and an episode owns gets the handshake
            # protocol (`legacy`): the server keeps a session for it (mcp-session-id), which the
            # stateless 2026 protocol of `auto` does not; a user's URL server is spoken to as it prefers
            own_session = self.spec.transport == "http" and not self.spec.stateless
            mode = "legacy" if own_session else "auto"
            async with Client(
                self._transport(),
                read_timeout_seconds=self.spec.call_timeout_s,
                mode=mode,
                message_handler=self._on_message,  # counts a stdio server's stdout noise
            ) as client:
                tools, cursor = [], None
                for _ in range(LIST_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools += list(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
                check_tool_list(tools)
                self.client, self.tools = client, tools
                self._ready.set_result(tools)
                await self._stop.wait()
        except asyncio.CancelledError:
            if self.failure is None and not self._stop.is_set():
                self.failure = self._fail("server_crashed", f"the session was cancelled{self._tail()}")
            if asyncio.current_task().cancelling():  # our own close: let the cancellation through
                raise
        except BaseException as exc:  # noqa: BLE001 - whatever the server did ends here, named
            kind = "connect_failed" if not self._ready.done() else "server_crashed"
            self.failure = self._fail(kind, _describe(exc) + self._tail())
        finally:
            if not self._ready.done():
                self._ready.set_exception(self.failure or self._fail("connect_failed", "no tool list"))
                self._ready.exception()  # retrieved: no "never retrieved" warning
            if self.failure is None and not self._stop.is_set():
                self.failure = self._fail("server_crashed", f"the session ended{self._tail()}")

    async def _on_message(self, message: Any) -> None:
        """The SDK's message handler: a stdio server's stdout line that is not JSON-RPC reaches it
        as its parse error (`mcp_noise.py`); notifications need nothing of us."""
        if not self.spec.url and mcp_noise.is_noise(message):
            self.noise_lines += 1
            if self.noise_sink is not None:
                self.noise_sink[self.spec.name] += 1
            mcp_noise.said(self.spec.name, message)

    def _fail(self, kind: str, detail: str) -> ServerFailure:
        return ServerFailure(self.spec.name, kind, detail)

    def _broken(self, kind: str, detail: str) -> ServerFailure:
        """A failure after which the session is not used again (a shared one is reopened)."""
        self.failure = self.failure or self._fail(kind, detail)
        return self._fail(kind, detail)

    def _tail(self) -> str:
        """The end of a stdio server's stderr, for the failure's message."""
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 4 * STDERR_TAIL))
            lines = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
            if lines:
                return f" (stderr: {' '.join(lines[-1].split())[:STDERR_TAIL]})"
        return ""

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """`tools/call`: the CallToolResult, or ServerFailure when the server hangs, dies or breaks the protocol.

        An error the server answers (JSON-RPC error, e.g. an unknown tool) is a result with
        `is_error`, as a tool's own failure is: the model reads it."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, TextContent
        from pydantic import ValidationError

        if not self.alive:
            raise self.failure or self._fail("server_crashed", "the session is closed")
        timeout = self.spec.call_timeout_s
        call = asyncio.ensure_future(self.client.call_tool(name, arguments, read_timeout_seconds=timeout))
        done, _ = await asyncio.wait({call, self._task}, timeout=timeout + 1.0, return_when=asyncio.FIRST_COMPLETED)
        if call not in done:
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
            if self._task in done:
                raise self.failure or self._broken("server_crashed", f"the session ended during {name!r}{self._tail()}")
            raise self._broken("call_timeout", f"{name!r} did not answer within {timeout:g} s")
        try:
            return call.result()
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise self._broken("call_timeout", f"{name!r} did not answer within {timeout:g} s") from None
            if exc.code == CONNECTION_CLOSED:
                raise self._broken("server_crashed", f"the connection closed during {name!r}{self._tail()}") from None
            return CallToolResult(content=[TextContent(type="text", text=exc.message)], is_error=True)
        except ValidationError as exc:
            raise self._fail("protocol_error", f"malformed result of {name!r}: {_describe(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - anything else the SDK raises is the server's failure
            raise self._fail("protocol_error", f"{name!r}: {_describe(exc)}") from None

    async def close(self) -> None:
        """End the session (a stdio server's process with it); bounded, safe to call twice."""
        task = self._task
        if task is None or task.done():
            self._close_stderr()
            return
        self._stop.set()
        done: set = set()
        if self._ready.done():  # connected: end the session gracefully first
            done, _ = await asyncio.shield(asyncio.wait({task}, timeout=CLOSE_S))
        if not done:  # still connecting, or stuck: cancel (the SDK still stops the process)
            task.cancel()
            await asyncio.shield(asyncio.wait({task}, timeout=CLOSE_S))
        self._close_stderr()

    def _close_stderr(self) -> None:
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()


# -- what passes through --------------------------------------------------------------------------
def check_tool_list(tools: list[Any]) -> None:
    """A server's tool list is one the prompt can hold: at most MAX_TOOLS tools, each schema nested
    at most MAX_JSON_DEPTH levels and at most MAX_SCHEMA_CHARS long as JSON; ValueError naming the
    first that is not (the connection then fails as `connect_failed`)."""
    from areal_core.proxy.strictjson import MAX_JSON_DEPTH, TooDeep, depth_of

    if len(tools) > MAX_TOOLS:
        raise ValueError(f"the server lists {len(tools)} tools, over the limit of {MAX_TOOLS}")
    for tool in tools:
        spec = openai_tool(tool)
        try:
            depth_of(spec, MAX_JSON_DEPTH)
        except TooDeep:
            raise ValueError(f"tool {str(tool.name)[:100]!r}: its input schema is nested too deeply") from None
        if len(json.dumps(spec, default=str)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"tool {str(tool.name)[:100]!r}: its schema is over {MAX_SCHEMA_CHARS} characters")


def openai_tool(tool: Any, name: str | None = None) -> dict[str, Any]:
    """An MCP `Tool` as an OpenAI function spec (`name` overrides the tool's, for a renamed duplicate)."""
    schema = tool.input_schema if isinstance(getattr(tool, "input_schema", None), dict) else {}
    params = {"type": "object", "properties": {}, **{k: v for k, v in schema.items() if k not in ("title", "$schema")}}
    fn: dict[str, Any] = {"name": name or tool.name, "parameters": params}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        types = _TYPES.get(k) if isinstance(k, str) else None
        if types is None:
            return True  # a type we do not check
        if isinstance(value, bool) and k in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def parse_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str]:
    """A model's tool-call arguments (a JSON string or an object) as a dict, or (None, the problem)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"arguments are not JSON ({exc.msg})"
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments, ""


def argument_problem(schema: dict[str, Any], args: dict[str, Any]) -> str:
    """'' when `args` fit the tool's input schema's top level (required keys, property types,
    no extra keys when additionalProperties is false), else what is wrong, in words."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        return f"missing argument(s) {', '.join(map(str, missing))}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            return f"unknown argument(s) {', '.join(extra)}"
    for key, value in args.items():
        spec = props.get(key)
        if isinstance(spec, dict) and "type" in spec and not _type_ok(value, spec["type"]):
            return f"argument {key!r} must be of type {spec['type']}, got {type(value).__name__}"
    return ""


def _part_text(part: Any) -> str:
    kind = getattr(part, "type", "")
    if kind == "text":
        return str(getattr(part, "text", ""))
    if kind == "resource":
        res = getattr(part, "resource", None)
        return str(getattr(res, "text", None) or f"[resource {getattr(res, 'uri', '')}]")
    if kind == "resource_link":
        return f"[resource {getattr(part, 'uri', '')}]"
    return f"[{kind or 'unknown'} content, {getattr(part, 'mime_type', '') or 'not shown'}]"


def result_text(result: Any, max_chars: int) -> tuple[str, list[str]]:
    """A CallToolResult as the tool message's text, and the events it gives (`tool_error`,
    `result_not_utf8`, `result_cut`)."""
    events: list[str] = []
    parts = [_part_text(p) for p in getattr(result, "content", None) or []]
    text = "\n".join(parts)
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        text = json.dumps(structured, ensure_ascii=False, default=str)
    clean = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates
    if clean != text or "\ufffd" in clean:
        events.append("result_not_utf8")
        clean += "\n[some bytes were not UTF-8 and were replaced]"
    if getattr(result, "is_error", False):
        events.append("tool_error")
        clean = clean if clean.startswith("error") else f"error: {clean}"
    if len(clean) > max_chars:
        events.append("result_cut")
        clean = clean[:max_chars] + f"\n[cut: {max_chars} of {len(clean)} characters shown]"
    return clean, events
