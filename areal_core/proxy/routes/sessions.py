"""Sessions: POST /v1/sessions, GET /v1/sessions/{id}, POST .../reward, POST .../end.

The id is matched as a path (`{session_id:path}`), so an id holding a separator (`a/b`, or
`a%2Fb`) reaches the manager and is refused as a name (400 `invalid_session_id`) instead of
missing a route; so are `%2E` and `%2E%2E`, which clients do not remove as dot segments."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from areal_core.proxy.routes.common import ERRORS, bearer, owner_of
from areal_core.proxy.schemas import (
    EndRequest,
    NewSessionRequest,
    RewardApplied,
    RewardRequest,
    SessionCreated,
    SessionEnded,
    SessionInfo,
)
from areal_core.proxy.state import State

router = APIRouter(tags=["sessions"], dependencies=[Depends(bearer)])


@router.post("/v1/sessions", responses={200: {"model": SessionCreated}, **ERRORS})
async def new_session(request: Request, state: State, body: NewSessionRequest | None = None):
    given = body.session_id if body else None  # an empty one is refused like any id that is not a name
    sid = f"sess-{uuid.uuid4().hex}" if given is None else given
    session = state.sessions.open(sid, owner_of(request))
    return {"session_id": session.id, "header": "X-Session-Id"}


@router.get("/v1/sessions/{session_id:path}", responses={200: {"model": SessionInfo}, **ERRORS})
async def get_session(session_id: str, request: Request, state: State, include_tokens: bool = Query(default=False)):
    return JSONResponse(state.sessions.get(session_id, owner_of(request)).summary(include_tokens))


@router.post("/v1/sessions/{session_id:path}/reward", responses={200: {"model": RewardApplied}, **ERRORS})
async def set_reward(session_id: str, body: RewardRequest, request: Request, state: State):
    target = await state.sessions.reward(session_id, owner_of(request), body.reward, body.turn, body.completion_id)
    return {"session_id": session_id, "reward": body.reward, "applied_to": target}


@router.post("/v1/sessions/{session_id:path}/end", responses={200: {"model": SessionEnded}, **ERRORS})
async def end_session(session_id: str, request: Request, state: State, body: EndRequest | None = None):
    body = body or EndRequest()
    session, samples, shards = await state.sessions.end(
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
                "image_ids": s.image_ids,
            }
            for s in samples
        ]
    return JSONResponse(out)
