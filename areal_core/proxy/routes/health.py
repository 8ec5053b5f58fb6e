"""GET /health (no key), GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from areal_core.proxy.routes.common import ERRORS, bearer
from areal_core.proxy.schemas import ModelCard, ModelList
from areal_core.proxy.state import State

router = APIRouter()


@router.get("/health", tags=["service"])
async def health(state: State) -> dict:
    out = {
        "ok": True,
        "policy_version": state.backend.version,
        "live_sessions": len(state.sessions.sessions),
        "sessions": dict(state.sessions.counters),
    }
    if (adm := state.sessions.admission) is not None:  # online mode: rows waiting for the trainer, and refusals
        out["admission"] = {
            "active": adm.active,
            "waiting_rows": adm.waiting(),
            "held_rows": state.sessions.held_rows,  # what the open sessions will write at least
            "bound": adm.bound,
            "refused_sessions": adm.refused,
        }
    if state.follower is not None:  # the serving version, what it holds, and whether the source is still followed
        out["serving"] = state.follower.describe()
        out["ok"] = state.follower.healthy()
    return out


@router.get(
    "/v1/models", tags=["openai"], dependencies=[Depends(bearer)], responses={200: {"model": ModelList}, **ERRORS}
)
async def list_models(state: State):
    return {"object": "list", "data": [state.model_card()]}


@router.get(
    "/v1/models/{model_id}",
    tags=["openai"],
    dependencies=[Depends(bearer)],
    responses={200: {"model": ModelCard}, **ERRORS},
)
async def get_model(model_id: str, state: State):
    """The served policy's card under the asked name: chat and completions serve the policy under
    any `model` name, so a client that checks its configured model first finds it."""
    return {**state.model_card(), "id": model_id}
