"""What the routers share: the documented error answers, the bearer scheme (for the OpenAPI
description; `GuardMiddleware` enforces the key), and who is asking for which session."""

from __future__ import annotations

import time
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer

from areal_core.proxy.decoding import sse_stream
from areal_core.proxy.guard import ProxyError
from areal_core.proxy.schemas import ErrorResponse, SamplingFields
from areal_core.proxy.sessions import session_id_for_key

ERRORS = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (
            400,
            "bad request: limits (context, max_tokens, n), unsupported content, a refused image (invalid_image, "
            "invalid_image_url, too_many_images, images_unsupported), a session id that is not a name "
            "(invalid_session_id) or another key's key-derived id (reserved_session_id), an option the engine "
            "cannot honour (unsupported_*: "
            "top_logprobs, response_format, tool_choice, penalty, logit_bias, suffix, best_of), a tool_choice "
            "naming no tool (invalid_tool_choice), top_logprobs without logprobs (invalid_top_logprobs), a reward "
            "naming two different turns (turn_mismatch)",
        ),
        (401, "missing or invalid API key"),
        (
            404,
            "no such live session of this key (the same answer for another key's session), or turn",
        ),
        (408, "the request's headers or body did not arrive in time (the connection is closed)"),
        (413, "request body over the size limit"),
        (415, "a body that is not application/json"),
        (
            422,
            "malformed body: not strict JSON (NaN/Infinity, lone surrogates, nested over 64 levels), schema, "
            "reward range",
        ),
        (
            429,
            "too many live sessions (in all, with this key at its fair share of them, or of this key: "
            "too_many_sessions), concurrent requests of this key (too_many_requests), the trainer behind "
            "(trainer_behind), or a turn starting a row beyond the session's max_session_rows "
            "(session_rows_exceeded, not worth retrying: x-should-retry false)",
        ),
    )
}

bearer = HTTPBearer(auto_error=False, description="API key; the guard middleware enforces it")


def owner_of(request: Request) -> str:
    """The digest of the request's API key, put in the scope by `GuardMiddleware`."""
    owner = request.scope.get("state", {}).get("owner")
    if owner is None:  # only reachable if the middleware was bypassed
        raise ProxyError(401, "invalid API key", "invalid_api_key", "authentication_error")
    return owner


def arrival_of(request: Request) -> float:
    """When the guard let the request in (perf_counter), else now."""
    return request.scope.get("state", {}).get("t_arrival", time.perf_counter())


def session_of(request: Request, x_session_id: str | None) -> tuple[str, str]:
    """(session id, owner): the X-Session-Id header when given (the manager refuses one that is not a
    name: sessions.check_session_id), else the session of the API key itself."""
    owner = owner_of(request)
    if x_session_id is not None:
        return x_session_id, owner
    auth = request.headers.get("authorization", "")
    return session_id_for_key(auth.partition(" ")[2].strip()), owner


def reply(
    req: SamplingFields,
    cid: str,
    objects: tuple[str, str],
    choice: dict,
    chunks: Iterable[dict],
    final: dict,
    usage: dict,
    areal: dict,
) -> JSONResponse | StreamingResponse:
    """A completion `objects[0]` with `choice` at index 0, or with stream=true an SSE stream of
    `objects[1]` chunks: `chunks`, then `final` carrying `areal`, then `usage` when asked."""
    head = {"id": cid, "object": objects[0], "created": int(time.time()), "model": req.model}
    if not req.stream:
        return JSONResponse({**head, "choices": [{"index": 0, **choice}], "usage": usage, "areal": areal})
    head["object"] = objects[1]
    with_usage = bool(req.stream_options and req.stream_options.include_usage)
    frames = sse_stream(head, chunks, final, areal, usage if with_usage else None)
    return StreamingResponse(frames, media_type="text/event-stream")
