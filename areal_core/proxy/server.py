"""OpenAI-compatible proxy in front of a rollout engine: serves the current policy and records
exactly what it served, so an agent episode becomes one trajectory row without re-tokenising.

    app = create_app(engine, tokenizer, api_keys=["sk-..."])       # a TorchEngine or any async backend
    server = ProxyServer(app).start()                               # uvicorn on 127.0.0.1, a free port
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-...")

Endpoints (all under /v1 need `Authorization: Bearer <key>`):
    GET  /v1/models, /v1/models/{id}
    POST /v1/chat/completions        non-streaming and streaming (SSE), tool calls
    POST /v1/completions             text or token-id prompts, streaming
    POST /v1/sessions                a new session id (optional: any X-Session-Id works)
    GET  /v1/sessions/{id}           what the session holds (?include_tokens=true for the ids)
    POST /v1/sessions/{id}/reward    {"reward": r, "turn": t | "completion_id": c | neither: final}
    POST /v1/sessions/{id}/end       {"reward"?, "discount"?, "group_id"?, "prompt_id"?, "meta"?}
    GET  /health                     no key needed

Every completion carries an extra top-level field `areal` (OpenAI clients ignore it):
session_id, turn, segment, prompt_token_ids (the whole prompt fed), token_ids (served),
logprobs (behaviour log-probs), versions (policy version per served token), timing.

The engine is synchronous, so `BatchingBackend` runs it on one thread and batches the
requests that wait together into one `generate` call.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer

from areal_core.proxy.backend import AsyncBackendAdapter, BatchingBackend, TimedGeneration, as_backend  # noqa: F401
from areal_core.proxy.decoding import cut_at_stop, sse, text_pieces, token_logprobs
from areal_core.proxy.guard import ApiKeys, GuardMiddleware, ProxyError, ProxyLimits, context_limit, error_body
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.schemas import (
    SESSION_ID_PATTERN,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EndRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    NewSessionRequest,
    RewardApplied,
    RewardRequest,
    SessionCreated,
    SessionEnded,
    SessionInfo,
    _SamplingFields,
)
from areal_core.proxy.sessions import SessionError, SessionManager, session_id_for_key
from areal_core.proxy.templating import ChatMLTemplate, TemplateError, parse_tool_calls
from areal_core.rollout.engine import SamplingParams

log = logging.getLogger("areal.proxy")

SESSION_HEADER = "x-session-id"


# ---------------------------------------------------------------------------------------------
# Request schemas (OpenAI's, the fields this proxy uses; unknown fields are ignored)
# ---------------------------------------------------------------------------------------------
_ERRORS = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (400, "bad request: limits (context, max_tokens, n), unsupported content, bad X-Session-Id"),
        (401, "missing or invalid API key"),
        (403, "the session belongs to another API key"),
        (404, "no such live session or turn"),
        (413, "request body over the size limit"),
        (422, "malformed body (schema validation)"),
        (429, "too many live sessions"),
    )
}


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------
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
) -> FastAPI:
    """The proxy app over `engine_backend` (a sync RolloutEngine, batched on one thread, or an
    object with an async `generate`).

    store: when given, each ended session is written there as one shard (online mode).
    sampling: server-side defaults; with force_sampling=True the request's temperature, top_p
    and top_k are ignored, so the behaviour policy is the one the trainer assumes (training).
    """
    limits = limits or ProxyLimits()
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys(api_keys)
    backend = as_backend(engine_backend)
    template = ChatMLTemplate(tokenizer, tool_prompt=tool_prompt)
    manager = SessionManager(
        template,
        worker_id=worker_id,
        turn_discount=turn_discount,
        store=store,
        session_ttl_s=limits.session_ttl_s,
        max_sessions=limits.max_sessions,
    )
    defaults = sampling or SamplingParams(max_new_tokens=limits.default_max_tokens)
    ctx_limit = context_limit(backend, limits.max_context_tokens)
    eos_id = template.eos_id
    owns_backend = backend is not engine_backend

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_backend:
            backend.close()

    app = FastAPI(
        title="AReaL-Flyte agent proxy",
        version="1.0",
        description=(
            "OpenAI-compatible chat/completions served by the current RL policy. Every response "
            "carries an extra `areal` object with the served token ids, behaviour log-probs and "
            "the policy version of each token. Sessions are keyed by API key or X-Session-Id."
        ),
        lifespan=lifespan,
    )
    app.state.backend = backend
    app.state.sessions = manager
    app.state.api_keys = keys
    app.state.template = template
    app.state.limits = limits
    app.state.context_limit = ctx_limit
    app.add_middleware(GuardMiddleware, keys=keys, max_request_bytes=limits.max_request_bytes)
    bearer = HTTPBearer(auto_error=False, description="API key; the guard middleware enforces it")

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.code), status_code=exc.status)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, exc: SessionError):
        kind = "permission_error" if exc.status == 403 else "invalid_request_error"
        return JSONResponse(error_body(exc.message, kind, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = jsonable_encoder(exc.errors(), custom_encoder={Exception: str})
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", []) if p != "body")
        msg = f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}"
        if first.get("type") == "json_invalid" or (
            first.get("loc") == ["body"] and isinstance(first.get("input"), str)
        ):
            msg = "invalid request: the body is not a JSON object"
        return JSONResponse(error_body(msg, "invalid_request_error", "validation_error", detail=errors), 422)

    def owner_of(request: Request) -> str:
        owner = request.scope.get("state", {}).get("owner")
        if owner is None:  # only reachable if the middleware was bypassed
            raise ProxyError(401, "invalid API key", "invalid_api_key", "authentication_error")
        return owner

    def session_id_of(request: Request, x_session_id: str | None) -> str:
        if x_session_id is not None:
            if not re.match(SESSION_ID_PATTERN, x_session_id):
                raise ProxyError(400, "X-Session-Id must be 1-128 of [A-Za-z0-9._:-]", "invalid_session_id")
            return x_session_id
        auth = request.headers.get("authorization", "")
        return session_id_for_key(auth.partition(" ")[2].strip())

    def sampling_for(req: _SamplingFields, max_new: int) -> SamplingParams:
        p = replace(defaults, max_new_tokens=max_new, stop_token_ids=list(defaults.stop_token_ids))
        if not force_sampling:
            if req.temperature is not None:
                p.temperature = req.temperature
                p.greedy = req.temperature == 0
            if req.top_p is not None:
                p.top_p = req.top_p
            if req.top_k is not None:
                p.top_k = req.top_k
        return p

    def budget(req: _SamplingFields, n_prompt: int, explicit: int | None) -> int:
        room = ctx_limit - n_prompt
        if room < 1:
            raise ProxyError(
                400,
                f"the prompt is {n_prompt} tokens; this model's context is {ctx_limit} tokens, "
                "so no room is left for a completion",
                "context_length_exceeded",
            )
        if explicit is not None:
            if explicit > limits.max_new_tokens:
                raise ProxyError(
                    400, f"max_tokens {explicit} exceeds the limit of {limits.max_new_tokens}", "max_tokens_too_large"
                )
            if explicit > room:
                raise ProxyError(
                    400,
                    f"prompt ({n_prompt} tokens) + max_tokens ({explicit}) exceeds this model's context of "
                    f"{ctx_limit} tokens",
                    "context_length_exceeded",
                )
            return explicit
        return min(defaults.max_new_tokens, limits.max_new_tokens, room)

    def check_common(req: _SamplingFields) -> None:
        if req.n != 1:
            raise ProxyError(400, "n > 1 is not supported: send one request per sample", "unsupported_n")

    async def run_turn(request: Request, x_session_id: str | None, plan_fn, req: _SamplingFields, explicit):
        """Plan, generate and commit one turn under the session's lock."""
        owner = owner_of(request)
        sid = session_id_of(request, x_session_id)
        for _ in range(3):
            session = manager.open(sid, owner)
            async with session.lock:
                if session.ended:  # ended while this request waited: start the next session
                    continue
                try:
                    plan = plan_fn(session)
                except TemplateError as exc:
                    raise ProxyError(400, str(exc), "invalid_messages") from None
                max_new = budget(req, len(plan.prompt_ids), explicit)
                params = sampling_for(req, max_new)
                t0 = time.perf_counter()
                try:
                    gen = await backend.generate(plan.prompt_ids, params)
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine failed")
                    raise ProxyError(500, f"engine error: {exc}", "engine_error", "server_error") from None
                return session, plan, gen, time.perf_counter() - t0
        raise ProxyError(409, f"session {sid!r} ended while the request waited", "session_ended")

    def areal_extra(request: Request, session, record, plan, gen, wall_s: float) -> dict:
        return {
            "session_id": session.id,
            "turn": record.turn,
            "segment": record.segment,
            "prompt_token_ids": plan.prompt_ids,
            "token_ids": gen.token_ids,
            "logprobs": gen.logprobs,
            "versions": gen.versions,
            "policy_version": backend.version,
            "timing": {
                "queue_s": getattr(gen, "queue_s", 0.0),
                "engine_s": getattr(gen, "engine_s", wall_s),
                "batch_size": getattr(gen, "batch_size", 1),
                "server_s": time.perf_counter() - request.scope.get("state", {}).get("t_arrival", time.perf_counter()),
            },
        }

    # -- routes ---------------------------------------------------------------------------
    @app.get("/health", tags=["service"])
    async def health() -> dict:
        return {
            "ok": True,
            "policy_version": backend.version,
            "live_sessions": len(manager.sessions),
            "sessions": dict(manager.counters),
        }

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "areal",
            "areal": {"policy_version": backend.version, "context_tokens": ctx_limit},
        }

    @app.get(
        "/v1/models", tags=["openai"], dependencies=[Depends(bearer)], responses={200: {"model": ModelList}, **_ERRORS}
    )
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model_id}",
        tags=["openai"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": ModelCard}, **_ERRORS},
    )
    async def get_model(model_id: str):
        return model_card()

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        dependencies=[Depends(bearer)],
        responses={
            200: {
                "model": ChatCompletionResponse,
                "description": "a chat.completion, or with stream=true an SSE stream of chat.completion.chunk "
                "objects whose last chunk carries `areal`",
            },
            **_ERRORS,
        },
    )
    async def chat_completions(
        req: ChatCompletionRequest, request: Request, x_session_id: str | None = Header(default=None)
    ):
        check_common(req)
        if len(req.messages) > limits.max_messages:
            raise ProxyError(400, f"{len(req.messages)} messages exceed the limit of {limits.max_messages}")
        explicit = req.max_completion_tokens or req.max_tokens
        tools = req.tools if req.tool_choice != "none" else None
        session, plan, gen, wall = await run_turn(
            request, x_session_id, lambda s: s.plan_chat(req.messages, tools), req, explicit
        )
        gen, text, stopped = cut_at_stop(tokenizer, eos_id, gen, req.stop)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        parsed = parse_tool_calls(text, id_prefix=f"call_{cid[9:21]}") if tools else None
        content = parsed.content if parsed else text
        calls = parsed.tool_calls if parsed else []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else ("stop" if stopped else gen.finish_reason)
        record = session.commit(plan, gen, cid, finish, assistant_message=message, tool_calls=len(calls))
        manager.counters["turns"] += 1
        usage = {
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": len(gen.token_ids),
            "total_tokens": len(plan.prompt_ids) + len(gen.token_ids),
        }
        extra = areal_extra(request, session, record, plan, gen, wall)
        lp = {"content": token_logprobs(tokenizer, gen), "refusal": None} if req.logprobs else None
        created = int(time.time())
        if not req.stream:
            return JSONResponse(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": req.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}],
                    "usage": usage,
                    "areal": extra,
                }
            )

        def chunk(delta: dict, finish_reason: str | None = None, **more: Any) -> bytes:
            body = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
                **more,
            }
            return sse(body)

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            for piece in text_pieces(tokenizer, gen, content or ""):
                yield chunk({"content": piece})
            for i, call in enumerate(calls):
                yield chunk({"tool_calls": [{"index": i, **call}]})
            yield chunk({}, finish, areal=extra)
            if req.stream_options and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": req.model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post(
        "/v1/completions",
        tags=["openai"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": CompletionResponse}, **_ERRORS},
    )
    async def completions(req: CompletionRequest, request: Request, x_session_id: str | None = Header(default=None)):
        check_common(req)
        if req.echo:
            raise ProxyError(400, "echo is not supported", "unsupported_echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ProxyError(400, "send one prompt per request", "unsupported_batch")
            prompt = prompt[0]
        if isinstance(prompt, list) and any(not 0 <= t < len(tokenizer) for t in prompt):
            raise ProxyError(400, f"prompt token ids must be in 0..{len(tokenizer) - 1}", "invalid_token_id")
        explicit = req.max_tokens
        session, plan, gen, wall = await run_turn(request, x_session_id, lambda s: s.plan_text(prompt), req, explicit)
        gen, text, stopped = cut_at_stop(tokenizer, eos_id, gen, req.stop)
        cid = f"cmpl-{uuid.uuid4().hex}"
        finish = "stop" if stopped else gen.finish_reason
        record = session.commit(plan, gen, cid, finish, completion_text=text)
        manager.counters["turns"] += 1
        usage = {
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": len(gen.token_ids),
            "total_tokens": len(plan.prompt_ids) + len(gen.token_ids),
        }
        extra = areal_extra(request, session, record, plan, gen, wall)
        lp = None
        if req.logprobs is not None:
            toks = [tokenizer.decode([t]) for t in gen.token_ids]
            offsets, pos = [], 0
            for s in toks:
                offsets.append(pos)
                pos += len(s)
            lp = {
                "tokens": toks,
                "token_logprobs": gen.logprobs,
                "top_logprobs": [{} for _ in toks],
                "text_offset": offsets,
            }
        created = int(time.time())
        if not req.stream:
            return JSONResponse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": req.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
                    "usage": usage,
                    "areal": extra,
                }
            )

        async def events():
            for piece in text_pieces(tokenizer, gen, text):
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": req.model,
                        "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}],
                    }
                )
            yield sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": req.model,
                    "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}],
                    "areal": extra,
                }
            )
            if req.stream_options and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": req.model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post(
        "/v1/sessions",
        tags=["sessions"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": SessionCreated}, **_ERRORS},
    )
    async def new_session(request: Request, body: NewSessionRequest | None = None):
        sid = (body.session_id if body else None) or f"sess-{uuid.uuid4().hex}"
        session = manager.open(sid, owner_of(request))
        return {"session_id": session.id, "header": "X-Session-Id"}

    @app.get(
        "/v1/sessions/{session_id}",
        tags=["sessions"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": SessionInfo}, **_ERRORS},
    )
    async def get_session(session_id: str, request: Request, include_tokens: bool = Query(default=False)):
        return JSONResponse(manager.get(session_id, owner_of(request)).summary(include_tokens))

    @app.post(
        "/v1/sessions/{session_id}/reward",
        tags=["sessions"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": RewardApplied}, **_ERRORS},
    )
    async def set_reward(session_id: str, body: RewardRequest, request: Request):
        session = manager.get(session_id, owner_of(request))
        async with session.lock:
            if session.ended:
                raise SessionError(404, f"no live session {session_id!r}", "unknown_session")
            target = session.set_reward(body.reward, body.turn, body.completion_id)
        return {"session_id": session_id, "reward": body.reward, "applied_to": target}

    @app.post(
        "/v1/sessions/{session_id}/end",
        tags=["sessions"],
        dependencies=[Depends(bearer)],
        responses={200: {"model": SessionEnded}, **_ERRORS},
    )
    async def end_session(session_id: str, request: Request, body: EndRequest | None = None):
        body = body or EndRequest()
        session, samples, shards = await manager.end(
            session_id,
            owner_of(request),
            reward=body.reward,
            discount=body.discount,
            group_id=body.group_id,
            prompt_id=body.prompt_id,
            meta=body.meta,
        )
        out: dict[str, Any] = {
            "session_id": session_id,
            "turns": len(session.turns),
            "rows": [
                {"sample_id": s.sample_id, "num_tokens": len(s.input_ids), "num_turns": s.num_turns, "reward": s.reward}
                for s in samples
            ],
            "shards": shards,
        }
        if body.return_trajectory:
            out["trajectories"] = [
                {
                    "sample_id": s.sample_id,
                    "input_ids": s.input_ids,
                    "prompt_len": s.prompt_len,
                    "loss_mask": s.loss_mask,
                    "behav_logprobs": s.behav_logprobs,
                    "versions": s.versions,
                    "reward": s.reward,
                    "token_rewards": s.token_rewards,
                }
                for s in samples
            ]
        return JSONResponse(out)

    return app


__all__ = [
    "ApiKeys",
    "AsyncBackendAdapter",
    "BatchingBackend",
    "ProxyLimits",
    "ProxyServer",
    "TimedGeneration",
    "create_app",
]


if __name__ == "__main__":
    from areal_core.proxy.cli import main

    main()
