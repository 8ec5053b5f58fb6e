"""OpenAI-compatible proxy in front of a rollout engine: serves the current policy and records
exactly what it served, so an agent episode becomes one trajectory row without re-tokenising.

    app = create_app(engine, tokenizer, api_keys=["sk-..."])       # a RolloutEngine, or the worker's AsyncEngine
    server = ProxyServer(app).start()                               # uvicorn on 127.0.0.1, a free port
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-...")

Endpoints (all under /v1 need `Authorization: Bearer <key>`), one router each in routes/:
    GET  /v1/models, /v1/models/{id}                                        health.py
    POST /v1/chat/completions        non-streaming and streaming (SSE), tool calls   chat.py
    POST /v1/completions             text or token-id prompts, streaming    completions.py
    POST /v1/sessions                a new session id (optional: any X-Session-Id works)   sessions.py
    GET  /v1/sessions/{id}           what the session holds (?include_tokens=true for the ids)
    POST /v1/sessions/{id}/reward    {"reward": r, "turn": t | "completion_id": c | neither: final}
    POST /v1/sessions/{id}/end       {"reward"?, "discount"?, "group_id"?, "prompt_id"?, "meta"?}
    GET  /health                     no key needed                          health.py

A vision-language model (its VisionProcessor as `tokenizer`, on the torch engine) also takes
OpenAI `image_url` content parts holding data URIs (proxy/images.py; docs/vlm.md).

Every completion carries an extra top-level field `areal` (OpenAI clients ignore it):
session_id, turn, segment, prompt_token_ids (the whole prompt fed), token_ids (served),
logprobs (behaviour log-probs), versions (policy version per served token), timing.

The engine is synchronous, so `rollout.async_engine.AsyncEngine` runs it on one thread and batches the
requests that wait together into one `generate` call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_core.proxy.backend import as_backend
from areal_core.proxy.guard import ApiKeys, GuardMiddleware, ProxyError, ProxyLimits, context_limit, error_body
from areal_core.proxy.images import image_refusal, vision_token_ids
from areal_core.proxy.manager import SessionManager
from areal_core.proxy.routes import chat, completions, health, sessions
from areal_core.proxy.routes.errors import session_problem
from areal_core.proxy.sessions import SessionProblem
from areal_core.proxy.state import ProxyState
from areal_core.proxy.templating import ChatTemplate
from areal_core.rollout.engine import SamplingParams


def create_app(
    engine_backend: Any,
    tokenizer: Any,
    store: Any = None,
    api_keys: Iterable[str] | ApiKeys = (),
    limits: ProxyLimits | None = None,
    *,
    model_name: str = "areal-policy",
    worker_id: str = "proxy-0",
    turn_discount: float = 1.0,
    tool_prompt: str = "full",
    sampling: SamplingParams | None = None,
    force_sampling: bool = False,
    follower: Any = None,
    admission: Any = None,
) -> FastAPI:
    """The proxy app over `engine_backend`: a RolloutEngine (put behind an AsyncEngine, closed
    with the app) or an AsyncEngine (the rollout worker's, left open).

    store: when given, each ended session is written there as one shard (online mode).
    sampling: server-side defaults; with force_sampling=True the request's temperature, top_p
    and top_k are ignored, so the behaviour policy is the one the trainer assumes (training).
    follower: a `proxy/versions.Follower` over the engine (started here, stopped with the app):
    /health then reports the serving version and what it holds, every completion its
    `model_version`.
    admission: a `proxy/backpressure.SessionAdmission` (online mode): no new session, a 429, while
    the run's trainer has not settled enough of this proxy's rows.
    """
    limits = limits or ProxyLimits()
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys(api_keys)
    backend = as_backend(engine_backend)
    template = ChatTemplate(tokenizer, tool_prompt=tool_prompt)
    manager = _session_manager(template, limits, worker_id, turn_discount, store, admission)
    state = ProxyState(
        backend=backend,
        owns_backend=backend is not engine_backend,
        tokenizer=tokenizer,
        template=template,
        sessions=manager,
        api_keys=keys,
        limits=limits,
        context_limit=context_limit(backend, limits.max_context_tokens),
        defaults=sampling or SamplingParams(max_new_tokens=limits.default_max_tokens),
        force_sampling=force_sampling,
        model_name=model_name,
        follower=follower,
        image_refusal=image_refusal(tokenizer, backend),
        vision_tokens=vision_token_ids(tokenizer),
    )
    return _app_over(state)


def _session_manager(
    template: ChatTemplate,
    limits: ProxyLimits,
    worker_id: str,
    turn_discount: float,
    store: Any,
    admission: Any,
) -> SessionManager:
    """The proxy's sessions, bounded by `limits` (create_app's docstring for the rest)."""
    return SessionManager(
        template,
        worker_id=worker_id,
        turn_discount=turn_discount,
        store=store,
        session_ttl_s=limits.session_ttl_s,
        max_sessions=limits.max_sessions,
        max_sessions_per_key=limits.max_sessions_per_key,
        reward_range=(limits.reward_min, limits.reward_max),
        max_key_session_segments=limits.max_key_session_segments,
        max_key_session_tokens=limits.max_key_session_tokens,
        admission=admission,
        max_session_rows=limits.max_session_rows,
    )


def _app_over(state: ProxyState) -> FastAPI:
    """The FastAPI app serving `state`: its guard (keys, limits), error handlers and routes."""
    backend, manager, keys, limits = state.backend, state.sessions, state.api_keys, state.limits
    template = state.template
    app = FastAPI(
        title="AReaL-Flyte agent proxy",
        version="1.0",
        description=(
            "OpenAI-compatible chat/completions served by the current RL policy. Every response "
            "carries an extra `areal` object with the served token ids, behaviour log-probs and "
            "the policy version of each token. Sessions are keyed by API key or X-Session-Id."
        ),
        lifespan=_lifespan,
    )
    app.state.proxy = state
    # the parts callers reach for (agent runner, tests)
    app.state.backend, app.state.sessions, app.state.api_keys = backend, manager, keys
    app.state.template, app.state.limits, app.state.context_limit = template, limits, state.context_limit
    app.add_middleware(GuardMiddleware, keys=keys, limits=limits)
    app.add_exception_handler(ProxyError, _proxy_error)
    app.add_exception_handler(SessionProblem, session_problem)  # each one's status: routes/errors.py
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for module in (health, chat, completions, sessions):
        app.include_router(module.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ProxyState = app.state.proxy
    if state.follower is not None:
        state.follower.start()
    yield
    if state.follower is not None:
        state.follower.stop()
    if state.sessions.writer is not None:
        state.sessions.writer.close()
    if state.sessions.admission is not None:
        state.sessions.admission.close()
    if state.owns_backend:
        state.backend.close()


async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.code), status_code=exc.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown path 404, wrong method 405) in the error shape too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    body = error_body(str(exc.detail), code=code)
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 in OpenAI's error shape; the first error names the field (`param`), pydantic's list is
    `detail` without the offending input (it may be large, or not JSON at all)."""
    errors = [{k: v for k, v in e.items() if k not in ("input", "ctx", "url")} for e in exc.errors()]
    errors = jsonable_encoder(errors, custom_encoder={Exception: str})
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", []) if p != "body")
    msg = f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}"
    raw = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid" or (first.get("loc") == ["body"] and isinstance(raw.get("input"), str)):
        msg, where = "invalid request: the body is not a JSON object", ""  # no field: not a character offset
    body = error_body(msg, "invalid_request_error", "validation_error", param=where or None, detail=errors)
    return JSONResponse(body, 422)
