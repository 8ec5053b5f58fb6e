"""Running a proxy app in-process: uvicorn on a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI


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
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=60, backlog=4096
        )
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
