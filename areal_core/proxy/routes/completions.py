"""POST /v1/completions: a text or token-id prompt, non-streaming or streaming (SSE)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Header, Request

from areal_core.proxy.decoding import completion_logprobs, cut_at_stop, piece_choices, token_pieces, usage
from areal_core.proxy.guard import ProxyError
from areal_core.proxy.options import check_completion
from areal_core.proxy.routes.common import ERRORS, arrival_of, bearer, reply, session_of
from areal_core.proxy.schemas import CompletionRequest, CompletionResponse
from areal_core.proxy.state import State

router = APIRouter()


@router.post(
    "/v1/completions",
    tags=["openai"],
    dependencies=[Depends(bearer)],
    responses={200: {"model": CompletionResponse}, **ERRORS},
)
async def completions(
    req: CompletionRequest, request: Request, state: State, x_session_id: str | None = Header(default=None)
):
    check_completion(req, state.force_sampling)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ProxyError(400, "send one prompt per request", "unsupported_batch")
        prompt = prompt[0]
    tok = state.tokenizer
    if isinstance(prompt, list) and any(not 0 <= t < len(tok) for t in prompt):
        raise ProxyError(400, f"prompt token ids must be in 0..{len(tok) - 1}", "invalid_token_id")
    sid, owner = session_of(request, x_session_id)
    turn = await state.run_turn(sid, owner, lambda s: s.plan_text(prompt), req, req.max_tokens)
    gen, text, stopped = cut_at_stop(tok, state.template.eos_id, turn.gen, req.stop)
    turn.gen = gen
    cid = f"cmpl-{uuid.uuid4().hex}"
    finish = "stop" if stopped else gen.finish_reason
    record = turn.session.commit(turn.plan, gen, cid, finish, completion_text=text)
    await state.committed(turn)
    extra = state.areal_extra(turn, record, arrival_of(request))
    lp = completion_logprobs(tok, gen) if req.logprobs is not None else None
    final: dict[str, Any] = {"text": "", "finish_reason": finish}
    part = (lambda a, b: {k: v[a:b] for k, v in lp.items()}) if lp is not None else None
    pieces = token_pieces(tok, gen, text)
    return reply(
        req,
        cid,
        ("text_completion", "text_completion"),
        {"text": text, "finish_reason": finish, "logprobs": lp},
        piece_choices(pieces, lambda piece: {"text": piece, "finish_reason": None}, part, len(gen.token_ids), final),
        final,
        usage(len(turn.plan.prompt_ids), len(gen.token_ids)),
        extra,
    )
