"""The proxy's front door: API keys (401), per-key concurrency (429), the request-size guard
(413), content type (415), strict JSON (422), the limits, and the error shape every 4xx/5xx
response shares."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from areal_core.proxy import strictjson
from areal_core.proxy.images import MAX_REQUEST_PIXELS
from areal_core.proxy.sessions import key_digest
from areal_core.proxy.strictjson import MAX_JSON_DEPTH

log = logging.getLogger("areal.proxy")


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


def error_body(
    message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None, **extra: Any
) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (+ `extra` beside it)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}, **extra}


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


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as strict JSON (`strictjson.loads`: UTF-8, no NaN/Infinity, float64/int64 numbers,
    no lone surrogate, at most `max_depth` levels of nesting), else ValueError with the reason."""
    try:
        return strictjson.loads(body, max_depth)
    except (strictjson.NotJson, strictjson.TooDeep) as exc:
        raise ValueError(f"the body is {exc}") from None


def _json_media(content_type: str) -> bool:
    """True for no content type (clients that omit it get JSON parsing), application/json, */*+json."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


def _as_json(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers with one content type, application/json. The guard has checked the body
    as JSON (no content type, an empty one, or a JSON media type); FastAPI would not parse a body
    without a content type as JSON (its `strict_content_type`), which the guard promises to do."""
    return [(k, v) for k, v in headers if k.lower() != b"content-type"] + [(b"content-type", b"application/json")]


class GuardMiddleware:
    """ASGI middleware run before routing and body parsing.

    On /v1: the API key (401, before the body is read), the key's concurrent requests (429), the
    body size (413), its content type (415) and strict JSON (422: see `parse_json`), so that no
    malformed body reaches a handler. On every route: an unexpected exception is a 500 in the
    error shape (the connection stays open) instead of a reset. The authenticated key's digest
    goes into scope["state"]["owner"] for the handlers.
    """

    def __init__(self, app: Any, keys: ApiKeys, limits: ProxyLimits):
        self.app, self.keys, self.limits = app, keys, limits
        self.in_flight: dict[str, int] = {}  # key digest -> requests being served (one event loop: no lock)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if scope["path"].startswith("/v1"):
                await self._v1(scope, receive, tracked)
            else:
                await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # the response is half sent: nothing to do but let the server drop it
                raise
            await _send_json(send, 500, error_body("internal server error", "server_error", "internal_error"))

    async def _v1(self, scope: dict, receive: Any, send: Any) -> None:
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
        limit = self.limits.max_concurrent_per_key
        if self.in_flight.get(owner, 0) >= limit:
            msg = f"too many concurrent requests for this API key (limit {limit})"
            await _send_json(
                send, 429, error_body(msg, "rate_limit_error", "too_many_requests"), [(b"retry-after", b"1")]
            )
            return
        self.in_flight[owner] = self.in_flight.get(owner, 0) + 1
        try:
            state = scope.setdefault("state", {})
            state["owner"], state["t_arrival"] = owner, time.perf_counter()
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive, send)
                if body is None:
                    return
                if body.strip():
                    scope["headers"] = _as_json(scope["headers"])
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
        finally:
            self.in_flight[owner] -= 1
            if not self.in_flight[owner]:
                del self.in_flight[owner]

    async def _read_body(self, headers: dict, receive: Any, send: Any) -> bytes | None:
        """The whole body when it passes the size, content-type and JSON checks; else None after
        answering 413, 415 or 422 (or on a client disconnect)."""
        limit = self.limits.max_request_bytes
        declared = headers.get(b"content-length")
        too_big = error_body(f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, too_big)
            return None
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_json(send, 413, too_big)
                return None
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        if not body.strip():
            return body
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if not _json_media(content_type):
            msg = f"unsupported content type {content_type[:100]!r}: send application/json"
            await _send_json(send, 415, error_body(msg, code="unsupported_media_type"))
            return None
        try:
            parse_json(body, self.limits.max_json_depth)
        except ValueError as exc:
            await _send_json(send, 422, error_body(f"invalid request: {exc}", code="validation_error"))
            return None
        return body


class ProxyError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


@dataclass
class ProxyLimits:
    max_request_bytes: int = 1 << 20  # 413 above
    max_json_depth: int = MAX_JSON_DEPTH  # nesting levels of a JSON body or of tool-call arguments (422 above)
    max_context_tokens: int | None = None  # prompt + completion; None: the engine model's positions, else 4096
    max_new_tokens: int = 1024  # an explicit max_tokens above this is a 400
    default_max_tokens: int = 256  # when the request gives none (cut to the room left in the context)
    max_messages: int = 512
    max_tools: int = 128  # tools in one chat request (400 above; OpenAI's own limit): each is rendered into the prompt
    max_images: int = 4  # image_url parts in one chat request, its history included (400 above; a VLM only)
    max_image_pixels: int = (
        MAX_REQUEST_PIXELS  # w·h of one request image (400 above): bounds its vision tokens and pixels
    )
    # live sessions of all keys together (429 above; a key below its fair share takes an idle session's place,
    # a key's implicit session is never refused: proxy/manager.py)
    max_sessions: int = 100_000
    max_sessions_per_key: int = 1_000  # live sessions of one key (429 above): one key cannot fill the table
    # rows (segments) one session may write: a turn starting one more is a 429 `session_rows_exceeded`; with
    # online admission, waiting rows ≤ bound + (max_session_rows − 1) × open sessions. None: no cap
    max_session_rows: int | None = 64
    max_concurrent_per_key: int = 64  # requests of one key being served at once (429 above)
    session_ttl_s: float = 3600.0
    # a key's implicit session (no X-Session-Id) is ended, its rows written, at either cap (None: no cap)
    max_key_session_segments: int | None = 256
    max_key_session_tokens: int | None = 262_144
    reward_min: float = -10.0  # every reward a client gives must be finite and within [reward_min, reward_max]
    reward_max: float = 10.0
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this (else 408, closed)
    body_timeout_s: float = 30.0  # its body within this after the headers (else 408, closed)
    keep_alive_s: float = 60.0  # an idle keep-alive connection is closed after this


def context_limit(engine_backend: Any, configured: int | None) -> int:
    """The configured context limit, else the engine model's max positions, else 4096."""
    if configured:
        return configured
    inner = getattr(engine_backend, "engine", engine_backend)
    config = getattr(getattr(inner, "model", None), "config", None)
    n = getattr(config, "max_position_embeddings", None)
    n = n or getattr(getattr(config, "text_config", None), "max_position_embeddings", None)  # a VLM's LM
    return int(n) if n else 4096
