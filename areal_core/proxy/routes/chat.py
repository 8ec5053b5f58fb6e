"""POST /v1/chat/completions: non-streaming and streaming (SSE), tool calls."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from areal_core.proxy.decoding import cut_at_stop, piece_choices, token_logprobs, token_pieces, usage
from areal_core.proxy.guard import ProxyError
from areal_core.proxy.images import ImageRefused, count_images, request_images
from areal_core.proxy.options import check_chat
from areal_core.proxy.routes.common import ERRORS, arrival_of, bearer, reply, session_of
from areal_core.proxy.schemas import ChatCompletionRequest, ChatCompletionResponse
from areal_core.proxy.state import State
from areal_core.proxy.templating import parse_tool_calls
from areal_core.rollout.engine import Generation

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    tags=["openai"],
    dependencies=[Depends(bearer)],
    responses={
        200: {
            "model": ChatCompletionResponse,
            "description": "a chat.completion, or with stream=true an SSE stream of chat.completion.chunk "
            "objects whose last chunk carries `areal`",
        },
        **ERRORS,
    },
)
async def chat_completions(
    req: ChatCompletionRequest, request: Request, state: State, x_session_id: str | None = Header(default=None)
):
    check_chat(req, state.force_sampling)
    limit = state.limits.max_messages
    if len(req.messages) > limit:
        raise ProxyError(400, f"{len(req.messages)} messages exceed the limit of {limit}")
    if len(req.tools or []) > state.limits.max_tools:
        raise ProxyError(400, f"{len(req.tools)} tools exceed the limit of {state.limits.max_tools}", "too_many_tools")
    images = None
    if count_images(req.messages):  # decoding is CPU work: off the event loop; refused before any session opens
        try:
            lim = state.limits
            images = await run_in_threadpool(
                request_images, req.messages, lim.max_images, state.image_refusal, lim.max_image_pixels
            )
        except ImageRefused as exc:
            raise ProxyError(400, exc.message, exc.code) from None
    tools = req.tools if req.tool_choice != "none" else None
    sid, owner = session_of(request, x_session_id)
    explicit = req.max_completion_tokens or req.max_tokens
    turn = await state.run_turn(sid, owner, lambda s: s.plan_chat(req.messages, tools, images), req, explicit)
    tok = state.tokenizer
    gen, text, stopped = cut_at_stop(tok, state.template.eos_id, turn.gen, req.stop)
    turn.gen = gen
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    parsed = parse_tool_calls(text, id_prefix=f"call_{cid[9:21]}") if tools else None
    content = parsed.content if parsed else text
    calls = parsed.tool_calls if parsed else []
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else ("stop" if stopped else gen.finish_reason)
    record = turn.session.commit(turn.plan, gen, cid, finish, assistant_message=message, tool_calls=len(calls))
    await state.committed(turn)
    extra = state.areal_extra(turn, record, arrival_of(request))
    entries = token_logprobs(tok, gen) if req.logprobs else None
    lp = {"content": entries, "refusal": None} if entries is not None else None
    final: dict[str, Any] = {"delta": {}, "finish_reason": finish}
    return reply(
        req,
        cid,
        ("chat.completion", "chat.completion.chunk"),
        {"message": message, "finish_reason": finish, "logprobs": lp},
        _deltas(tok, gen, content or "", calls, entries, final),
        final,
        usage(len(turn.plan.prompt_ids), len(gen.token_ids)),
        extra,
    )


def _deltas(
    tokenizer: Any, gen: Generation, content: str, calls: list[dict], entries: list[dict] | None, final: dict
) -> Iterator[dict]:
    """The streamed choices before `final`: the role, the content per token (with its tokens'
    `logprobs.content` entries when `entries` is given), each tool call whole."""
    yield {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    lp = (lambda a, b: {"content": entries[a:b], "refusal": None}) if entries is not None else None
    pieces = token_pieces(tokenizer, gen, content)
    yield from piece_choices(pieces, _content_delta, lp, len(gen.token_ids), final)
    for i, call in enumerate(calls):
        yield {"delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None}


def _content_delta(piece: str) -> dict:
    return {"delta": {"content": piece}, "finish_reason": None}
