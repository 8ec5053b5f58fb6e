"""How the routes answer a session problem: one row per `SessionProblem` (proxy/sessions.py),
giving the status and OpenAI's error `type` and `code` for {"error": {"message", "type", "param",
"code"}}. The domain says what went wrong; only this table says it in HTTP.

No row answers 403: a session of another key is `SessionNotFound` (404, the same body as for an id
no key uses), and a key-derived id of another key given to open a session is `ReservedSessionId`
(400, refused by the id's form alone), so no answer tells a key whether another key's session exists."""

from __future__ import annotations

from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse

from areal_core.proxy.backpressure import TrainerBehind
from areal_core.proxy.guard import error_body
from areal_core.proxy.sessions import (
    InvalidReward,
    InvalidSessionId,
    ReservedSessionId,
    SessionFull,
    SessionNotFound,
    SessionProblem,
    TooManySessions,
    TurnMismatch,
    TurnOutOfRange,
    UnknownCompletion,
)


class Answer(NamedTuple):
    status: int
    type: str  # OpenAI's error type: what an SDK makes of it
    code: str
    prefix: str = ""  # before the problem's message
    retry: bool = True  # a 429 worth retrying (Retry-After: 1); else `x-should-retry: false`, which the SDK obeys


SESSION_ANSWERS: dict[type[SessionProblem], Answer] = {
    SessionNotFound: Answer(404, "invalid_request_error", "unknown_session"),
    InvalidSessionId: Answer(400, "invalid_request_error", "invalid_session_id"),
    ReservedSessionId: Answer(400, "invalid_request_error", "reserved_session_id"),
    UnknownCompletion: Answer(404, "invalid_request_error", "unknown_turn"),
    TurnOutOfRange: Answer(400, "invalid_request_error", "unknown_turn"),
    TurnMismatch: Answer(400, "invalid_request_error", "turn_mismatch"),
    InvalidReward: Answer(422, "invalid_request_error", "invalid_reward", "invalid request: "),
    TooManySessions: Answer(429, "rate_limit_error", "too_many_sessions"),
    TrainerBehind: Answer(429, "rate_limit_error", "trainer_behind"),
    SessionFull: Answer(429, "rate_limit_error", "session_rows_exceeded", retry=False),
}
UNMAPPED = Answer(500, "server_error", "session_error")  # a SessionProblem added without a row above


def answer_for(problem: SessionProblem) -> Answer:
    """The row of the problem's class, or of the nearest class above it that has one."""
    return next((SESSION_ANSWERS[c] for c in type(problem).__mro__ if c in SESSION_ANSWERS), UNMAPPED)


async def session_problem(request: Request, exc: SessionProblem) -> JSONResponse:
    """The exception handler `create_app` registers for every `SessionProblem`."""
    a = answer_for(exc)
    headers = None
    if a.status == 429:  # the openai SDK waits Retry-After, then retries; x-should-retry: false stops it
        headers = {"retry-after": "1"} if a.retry else {"x-should-retry": "false"}
    return JSONResponse(error_body(a.prefix + exc.message, a.type, a.code), status_code=a.status, headers=headers)
