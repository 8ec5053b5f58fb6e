"""The proxy's front door: API keys (401), the request-size guard (413) and the error shape
every 4xx/5xx response shares."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from areal_core.proxy.sessions import key_digest


class ApiKeys:
    """The accepted API keys, kept as SHA-256 digests; keys can be added and revoked at run time."""

    def __init__(self, keys: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._digests: set[str] = {key_digest(k) for k in keys}

    def add(self, key: str) -> None:
        with self._lock:
            self._digests.add(key_digest(key))

    def revoke(self, key: str) -> None:
        with self._lock:
            self._digests.discard(key_digest(key))

    def new_key(self, prefix: str = "sk-areal-") -> str:
        key = prefix + secrets.token_urlsafe(24)
        self.add(key)
        return key

    def check(self, key: str) -> str | None:
        """The key's digest when it is accepted, else None."""
        d = key_digest(key)
        return d if d in self._digests else None

    def __len__(self) -> int:
        return len(self._digests)


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None, **extra: Any) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}, **extra}


async def _send_json(send: Any, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """ASGI middleware run before routing and body parsing: API key (401), body size (413).

    The authenticated key's digest goes into scope["state"]["owner"] for the handlers.
    """

    def __init__(self, app: Any, keys: ApiKeys, max_request_bytes: int):
        self.app, self.keys, self.max_request_bytes = app, keys, max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        owner = self.keys.check(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if owner is None:
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
            await _send_json(
                send,
                401,
                error_body(msg, "authentication_error", "invalid_api_key"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        state = scope.setdefault("state", {})
        state["owner"], state["t_arrival"] = owner, time.perf_counter()
        limit = self.max_request_bytes
        declared = headers.get(b"content-length")
        too_big = error_body(
            f"request body exceeds the limit of {limit} bytes", "invalid_request_error", "request_too_large"
        )
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, too_big)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await _send_json(send, 413, too_big)
                    return
                chunks.append(chunk)
                if not msg.get("more_body"):
                    break
            body = b"".join(chunks)
            sent = False

            async def replay() -> dict:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


class ProxyError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


@dataclass
class ProxyLimits:
    max_request_bytes: int = 1 << 20  # 413 above
    max_context_tokens: int | None = None  # prompt + completion; None: the engine model's positions, else 4096
    max_new_tokens: int = 1024  # an explicit max_tokens above this is a 400
    default_max_tokens: int = 256  # when the request gives none (cut to the room left in the context)
    max_messages: int = 512
    max_sessions: int = 100_000
    session_ttl_s: float = 3600.0


def context_limit(engine_backend: Any, configured: int | None) -> int:
    """The configured context limit, else the engine model's max positions, else 4096."""
    if configured:
        return configured
    inner = getattr(engine_backend, "engine", engine_backend)
    model = getattr(inner, "model", None)
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if n else 4096
