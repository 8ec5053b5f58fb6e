"""Serving a proxy app: uvicorn with header and body timeouts (`server_config`), and
`ProxyServer`, uvicorn on a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import h11
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from areal_core.proxy.guard import ProxyLimits, error_body


def _error_response(status: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's error shape, closing the connection: for what
    is answered below the app (a deadline passed, bytes that are not HTTP)."""
    body = json.dumps(error_body(message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _timeout_response(message: str) -> bytes:
    return _error_response("408 Request Timeout", message, "request_timeout")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, so a slow or stalled client cannot hold a
    connection: a request's line and headers must arrive within `header_timeout_s` of its first
    byte (of the connection, for a new one), its body within `body_timeout_s` after the headers.
    Past a deadline the client gets 408 in the error shape (nothing when it sent nothing) and the
    connection is closed. Between requests uvicorn's keep-alive timeout applies; while the app
    works on a complete request no deadline runs. Deadlines are totals, not per chunk, so
    dripping a byte at a time does not extend them. Subclassed per server by `server_config`."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers bytes h11 cannot parse (a bad request line, bad chunked encoding, a bad
        Content-Length, a head over 16 KiB arriving in pieces) with a plain-text 400: this is the
        same answer in the error shape every other refusal has."""
        message = "the request is not valid HTTP/1.1 (a malformed line, header or body framing, or a head over 16 KiB)"
        self.transport.write(_error_response("400 Bad Request", message, "invalid_http_request"))
        self._set_phase(None)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _watch(self) -> None:
        """The phase the connection is in: "head" (a request's head is awaited and no keep-alive
        timer runs: a new connection, or bytes of the next request came), "body" or None."""
        their = self.conn.their_state
        if their is h11.SEND_BODY:
            self._set_phase("body")
        elif their is h11.IDLE and self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self._set_phase("head")
        else:
            self._set_phase(None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the running deadline stays: a total, not per chunk
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            limit = self.header_timeout_s if phase == "head" else self.body_timeout_s
            self._deadline = self.loop.call_later(limit, self._expire, phase, limit)

    def _expire(self, phase: str, limit: float) -> None:
        self._deadline = None
        if self._phase != phase or self.transport.is_closing():
            return
        answer = phase == "body" or bool(self.conn.trailing_data[0])
        if phase == "body" and self.cycle is not None:
            answer = not self.cycle.response_started
            self.cycle.disconnected = True  # the app's receive() sees http.disconnect; its sends are dropped
            self.cycle.message_event.set()
        if answer:
            what = "headers" if phase == "head" else "body"
            self.transport.write(_timeout_response(f"the request {what} did not arrive within {limit:g} s"))
        self._phase = None
        self.transport.close()


def server_config(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **kw: Any) -> Any:
    """The uvicorn.Config every proxy server runs with: `TimedH11Protocol` with the app's
    limits (header_timeout_s, body_timeout_s, keep_alive_s), heads up to 16 KiB."""
    import uvicorn

    limits: ProxyLimits = getattr(app.state, "limits", None) or ProxyLimits()
    protocol = type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s},
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=protocol,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=16 * 1024,
        **kw,
    )


class ProxyServer:
    """uvicorn on a background thread with its own event loop, on a free port by default."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app, self.host = app, host
        # proto=IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted connections (it checks the
        # proto); without it a response's header and body writes meet Nagle + delayed ACK (~40 ms).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        config = server_config(app, host, self.port, log_level, lifespan="on", backlog=4096)
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout_s: float = 30.0) -> ProxyServer:
        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

        self._thread = threading.Thread(target=run, name="areal-proxy-http", daemon=True)
        self._thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"proxy on {self.url} did not start")
            time.sleep(0.01)
        return self

    async def acall(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop (e.g. the session manager's) and await it here."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.sock.close()

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
