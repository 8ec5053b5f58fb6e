"""Lines a stdio MCP server writes to stdout that are not JSON-RPC: counted, not a traceback each.

A server that prints (a banner, progress, a library's chatter) writes onto the wire. The SDK's stdio
client (`mcp/client/stdio.py:_parse_line`) logs each such line with `logger.exception` on the
`mcp.client.stdio` logger, a traceback per line (about 1 MB an episode for a chatty server), and
passes the parse error on as a value into the session, which hands it to the client's
`message_handler`. A `Connection` (mcp.py) counts them there, per server (`mcp.noise_lines` in the
stats), and tells `said` of each; a filter on the SDK's logger drops those records of its sessions
(`OURS`: a context variable the connection's task sets, which the SDK's stdout reader task, started
inside it, inherits). A session of anyone else's in the process is logged as the SDK does.

What is logged instead, per server name and process: the first such line once, then at most one
count every `SUMMARY_S` seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from contextvars import ContextVar

SUMMARY_S = 60.0  # a server that keeps chattering: its running count at most this often
LINE_CHARS = 200  # of the first line, quoted
OURS: ContextVar[bool] = ContextVar("areal_mcp_counts_noise", default=False)
log = logging.getLogger("areal.agents.mcp")
_lock = threading.Lock()
_totals: Counter = Counter()  # server name -> lines, this process
_last_said: dict[str, float] = {}  # server name -> when its line or count was last logged


def is_noise(item: object) -> bool:
    """A transport item that is a stdout line the stdio client could not parse (a pydantic
    ValidationError, a ValueError; a line that was JSON-RPC is a message, never an exception)."""
    return isinstance(item, ValueError)


def line_of(exc: BaseException) -> str:
    """The line a parse error is about, quoted and cut at `LINE_CHARS`."""
    try:
        value = exc.errors()[0]["input"]  # type: ignore[attr-defined]
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    except Exception:  # noqa: BLE001 - not a pydantic error: its message stands for the line
        text = " ".join(str(exc).split())
    return repr(text[:LINE_CHARS]) + (" [cut]" if len(text) > LINE_CHARS else "")


def said(server: str, exc: BaseException) -> None:
    """Log `server`'s noise line at most as this module's doc says."""
    now = time.monotonic()
    with _lock:
        _totals[server] += 1
        total, last = _totals[server], _last_said.get(server)
        if last is not None and now - last < SUMMARY_S:
            return
        _last_said[server] = now
    if last is None:
        log.warning(
            "MCP server %r wrote a line to stdout that is not JSON-RPC: %s; such lines are counted "
            "(mcp.noise_lines), not logged each",
            server,
            line_of(exc),
        )
    else:
        log.warning("MCP server %r: %d lines on stdout that are not JSON-RPC so far", server, total)


class _DropParseTracebacks(logging.Filter):
    """On `mcp.client.stdio`: a parse error's record (with its traceback) is dropped in a session
    that counts its noise (`OURS`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (OURS.get() and is_noise(exc))


def install() -> None:
    """Put the filter on the SDK's stdio logger (once)."""
    sdk = logging.getLogger("mcp.client.stdio")
    if not any(isinstance(f, _DropParseTracebacks) for f in sdk.filters):
        sdk.addFilter(_DropParseTracebacks())
