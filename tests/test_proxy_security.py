"""Proxy security and bad input: API keys (401), size and token limits (413/400), schema
validation (422), unknown sessions and other keys' sessions (both 404, alike), with the real
`openai` SDK where a client would see them and raw HTTP where the SDK cannot send the input."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model, build_tokenizer
from areal_core.proxy.app import create_app
from areal_core.proxy.backpressure import SessionAdmission, TrainerBehind
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.routes.errors import SESSION_ANSWERS, answer_for
from areal_core.proxy.runner import ProxyServer
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
    session_id_for_key,
)
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store

KEY_A, KEY_B = "sk-alice", "sk-bob"
USER = [{"role": "user", "content": "Ann has 3 pens"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(["Ann has 3 pens and gets 4 more. How many pens now?", "3+4=7\n#### 7"], 300)


@pytest.fixture(scope="module")
def server(tok):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg.max_position_embeddings = 64
    engine = TorchEngine(build_tiny_model(cfg, len(tok), 0), tok.pad_token_id, tok.eos_token_id, 0, seed=0)
    limits = ProxyLimits(max_request_bytes=4096, max_new_tokens=16, default_max_tokens=8, max_messages=8)
    app = create_app(engine, tok, api_keys=[KEY_A, KEY_B], limits=limits)
    with ProxyServer(app) as s:
        yield s
    torch.set_num_threads(before)


def http(server, key: str | None = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def sdk(server, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


# -- API keys --------------------------------------------------------------------------------
def test_no_key_or_wrong_key_is_401(server):
    for path, method in (("/models", "GET"), ("/chat/completions", "POST"), ("/sessions/x/end", "POST")):
        r = http(server, None).request(method, path, json={"model": "m", "messages": USER})
        assert r.status_code == 401, path
        assert error_of(r)["code"] == "invalid_api_key" and "missing API key" in error_of(r)["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert http(server, "sk-wrong").request(method, path, json={}).status_code == 401
    basic = httpx.post(
        server.base_url + "/chat/completions", headers={"Authorization": f"Basic {KEY_A}"}, json={"x": 1}
    )
    assert basic.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "sk-wrong").chat.completions.create(model="m", messages=USER)
    assert httpx.get(server.url + "/health").status_code == 200  # the only open route


def test_key_checked_before_the_body_is_read(server):
    """A malformed or oversized body without a valid key still gets 401, never 413 or 422."""
    assert http(server, None).post("/chat/completions", content=b"{not json").status_code == 401
    assert http(server, "sk-wrong").post("/chat/completions", content=b"x" * 10_000).status_code == 401


def test_revoked_key_is_rejected(server):
    keys = server.app.state.api_keys
    temp = keys.new_key()
    assert http(server, temp).get("/models").status_code == 200
    keys.revoke(temp)
    assert http(server, temp).get("/models").status_code == 401


# -- size and token limits ---------------------------------------------------------------------
def test_oversized_body_is_413(server):
    big = [{"role": "user", "content": "x" * 5000}]
    r = http(server).post("/chat/completions", json={"model": "m", "messages": big})
    assert r.status_code == 413 and "4096 bytes" in error_of(r)["message"]

    def chunks():  # no content-length: counted while streaming in
        for _ in range(10):
            yield b" " * 1000

    r = http(server).post("/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    with pytest.raises(openai.APIStatusError) as exc:
        sdk(server).chat.completions.create(model="m", messages=big)
    assert exc.value.status_code == 413


def test_token_limits_are_400_with_a_message(server):
    long = [{"role": "user", "content": " ".join(["pens"] * 80)}]  # > 64 positions of this model
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(server).chat.completions.create(model="m", messages=long, extra_headers={"X-Session-Id": "lim-1"})
    assert "context is 64 tokens" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(server).chat.completions.create(model="m", messages=USER, max_tokens=17)
    assert "exceeds the limit of 16" in exc.value.body["message"]
    medium = [{"role": "user", "content": " ".join(["pens"] * 45)}]
    with pytest.raises(openai.BadRequestError) as exc:  # fits, but not with 16 more tokens
        sdk(server).chat.completions.create(model="m", messages=medium, max_tokens=16)
    assert exc.value.body["code"] == "context_length_exceeded"
    r = sdk(server).chat.completions.create(model="m", messages=medium, extra_headers={"X-Session-Id": "lim-2"})
    assert len(r.areal["prompt_token_ids"]) + len(r.areal["token_ids"]) <= 64  # default cut to the room left
    too_many = [{"role": "user", "content": "a"}] * 9
    assert http(server).post("/chat/completions", json={"model": "m", "messages": too_many}).status_code == 400
    assert http(server).post("/chat/completions", json={"model": "m", "messages": USER, "n": 2}).status_code == 400
    bad_ids = http(server).post("/completions", json={"model": "m", "prompt": [1, 2, 99999]})
    assert bad_ids.status_code == 400 and error_of(bad_ids)["code"] == "invalid_token_id"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = http(server).post("/chat/completions", json={"model": "m", "messages": image})
    assert r.status_code == 400 and "text content" in error_of(r)["message"]


# -- schema validation -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"model": "m"}',  # no messages
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}',
        b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": "hi"}]}',  # no model
    ],
)
def test_malformed_bodies_are_422(server, body):
    r = http(server).post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert error_of(r)["code"] == "validation_error" and error_of(r)["message"].startswith("invalid request")


def test_malformed_session_calls_are_422_or_400(server):
    c = http(server)
    c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "val-1"})
    assert c.post("/sessions/val-1/reward", json={"reward": "lots"}).status_code == 422
    assert c.post("/sessions/val-1/reward", content=b'{"reward": NaN}').status_code == 422
    assert c.post("/sessions/val-1/end", json={"discount": 2.0}).status_code == 422
    r = c.post("/sessions/val-1/reward", json={"reward": 1.0, "turn": 5})
    assert r.status_code == 400 and "has 1 turns" in error_of(r)["message"]
    r = c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "bad id!"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_session_id"
    for turn in (-1, 0.5, 1.0, True, "0"):  # a turn is a non-negative integer, nothing else
        r = c.post("/sessions/val-1/reward", json={"reward": 1.0, "turn": turn})
        assert r.status_code == 422 and error_of(r)["param"] == "turn", (turn, r.text)
    assert c.post("/sessions/val-1/end", json={}).status_code == 200


# -- unknown sessions and isolation -------------------------------------------------------------
def test_unknown_session_is_404(server):
    c = http(server)
    assert c.get("/sessions/nope").status_code == 404
    assert c.post("/sessions/nope/reward", json={"reward": 1.0}).status_code == 404
    r = c.post("/sessions/nope/end", json={})
    assert r.status_code == 404 and error_of(r)["code"] == "unknown_session"
    with pytest.raises(openai.NotFoundError):
        sdk(server).post("/sessions/nope/end", body={}, cast_to=dict)
    c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "once"})
    assert c.post("/sessions/once/end", json={}).status_code == 200
    assert c.post("/sessions/once/end", json={}).status_code == 404  # ended sessions are gone
    assert c.post("/sessions/once/reward", json={"reward": 1.0}).status_code == 404


def test_one_key_cannot_touch_another_keys_session(server):
    a, b = http(server, KEY_A), http(server, KEY_B)
    ra = sdk(server, KEY_A).chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": "alice-1"})
    before = a.get("/sessions/alice-1", params={"include_tokens": True}).json()
    # Bob can neither read, reward nor end Alice's session: for him it does not exist
    for r in (
        b.get("/sessions/alice-1"),
        b.post("/sessions/alice-1/reward", json={"reward": 9.0}),
        b.post("/sessions/alice-1/end", json={"reward": 9.0}),
    ):
        assert r.status_code == 404 and error_of(r)["code"] == "unknown_session"
    # nor extend or claim it: sessions are named within their key, the same name is Bob's own session
    rb1 = b.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "alice-1"})
    assert rb1.status_code == 200 and rb1.json()["areal"]["turn"] == 0
    assert b.post("/sessions", json={"session_id": "alice-1"}).json()["session_id"] == "alice-1"
    assert b.get("/sessions/alice-1").json()["turns"][0]["completion_id"] == rb1.json()["id"]
    # a key-keyed session is invisible to other keys, and its id is reserved for its key
    rk = sdk(server, KEY_A).chat.completions.create(model="m", messages=USER)
    assert b.post(f"/sessions/{rk.areal['session_id']}/end", json={}).status_code == 404
    with pytest.raises(openai.BadRequestError):
        sdk(server, KEY_B).chat.completions.create(
            model="m", messages=USER, extra_headers={"X-Session-Id": rk.areal["session_id"]}
        )
    # Bob's own key-keyed session is a different one
    rb = sdk(server, KEY_B).chat.completions.create(model="m", messages=USER)
    assert rb.areal["session_id"] != rk.areal["session_id"]
    after = a.get("/sessions/alice-1", params={"include_tokens": True}).json()
    assert after == before and after["final_reward"] is None  # untouched by Bob
    row = a.post("/sessions/alice-1/end", json={"return_trajectory": True}).json()["trajectories"][0]
    assert row["input_ids"] == ra.areal["prompt_token_ids"] + ra.areal["token_ids"]


def test_too_many_live_sessions_is_429(tok):
    engine = ScriptedEngine(tok, lambda _: "ok")
    app = create_app(engine, tok, api_keys=[KEY_A], limits=ProxyLimits(max_sessions=2))
    with ProxyServer(app) as s:
        c = http(s)
        for i in range(2):
            hdr = {"X-Session-Id": f"s{i}"}
            assert c.post("/chat/completions", json={"model": "m", "messages": USER}, headers=hdr).status_code == 200
        r = c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "s2"})
        assert r.status_code == 429
        assert c.post("/sessions/s0/end", json={}).status_code == 200
        r = c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "s2"})
        assert r.status_code == 200


def test_idle_sessions_expire(tok):
    engine = ScriptedEngine(tok, lambda _: "ok")
    app = create_app(engine, tok, api_keys=[KEY_A], limits=ProxyLimits(session_ttl_s=0.2))
    with ProxyServer(app) as s:
        c = http(s)
        r = c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "idle"})
        assert r.status_code == 200
        # a new session sweeps the idle ones; how soon "idle" passes its 0.2 s is the machine's business
        deadline, k = time.monotonic() + 120, 0
        while c.get("/sessions/idle").status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.3)
            k += 1
            r = c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": f"f{k}"})
            assert r.status_code == 200
        assert c.get("/sessions/idle").status_code == 404
        assert httpx.get(s.url + "/health").json()["sessions"]["expired"] >= 1


# -- each session problem: its status and error type ---------------------------------------------
def _turn(client: openai.OpenAI, sid: str) -> None:
    client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": sid})


def _reward(client: openai.OpenAI, sid: str, **body) -> None:
    client.post(f"/sessions/{sid}/reward", body=body, cast_to=dict)


def _ended(a: openai.OpenAI, b: openai.OpenAI) -> None:
    _turn(a, "p")
    a.post("/sessions/p/end", cast_to=dict)
    _reward(a, "p", reward=1)


def _mismatch(a: openai.OpenAI, b: openai.OpenAI) -> None:
    cid = a.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": "p"}).id
    _reward(a, "p", reward=1, turn=1, completion_id=cid)  # completion_id is turn 0


def _filled(a: openai.OpenAI, b: openai.OpenAI, then: Callable[[], Any]) -> None:
    _turn(a, "p")
    _turn(a, "q")
    then()


RESERVED = session_id_for_key(KEY_A)
# (id, problem, provoke(SDK client of KEY_A, of KEY_B), status, error type, code, message, the SDK's error)
PROBLEMS = [
    ("unknown", SessionNotFound, lambda a, b: a.post("/sessions/nope/end", body={}, cast_to=dict),
     404, "invalid_request_error", "unknown_session", "no live session 'nope'", openai.NotFoundError),
    ("ended", SessionNotFound, _ended,
     404, "invalid_request_error", "unknown_session", "no live session 'p'", openai.NotFoundError),
    ("completion", UnknownCompletion, lambda a, b: (_turn(a, "p"), _reward(a, "p", reward=1, completion_id="cmpl-x")),
     404, "invalid_request_error", "unknown_turn", "completion 'cmpl-x' is not in session 'p'", openai.NotFoundError),
    ("turn", TurnOutOfRange, lambda a, b: (_turn(a, "p"), _reward(a, "p", reward=1, turn=2)),
     400, "invalid_request_error", "unknown_turn", "turn 2 does not exist: session 'p' has 1 turns",
     openai.BadRequestError),
    ("mismatch", TurnMismatch, _mismatch, 400, "invalid_request_error", "turn_mismatch",
     "completion_id is turn 0 of session 'p', not turn 1: give one of turn and completion_id, or both naming the "
     "same turn", openai.BadRequestError),
    ("reward", InvalidReward, lambda a, b: (_turn(a, "p"), _reward(a, "p", reward=10.5)),
     422, "invalid_request_error", "invalid_reward",
     "invalid request: reward 10.5 is outside the allowed range [-10, 10]", openai.UnprocessableEntityError),
    ("another-key", SessionNotFound, lambda a, b: (_turn(a, "p"), b.get("/sessions/p", cast_to=dict)),
     404, "invalid_request_error", "unknown_session", "no live session 'p'", openai.NotFoundError),
    ("dot-dot", InvalidSessionId, lambda a, b: _turn(a, ".."),
     400, "invalid_request_error", "invalid_session_id", "invalid session id '..': '.' and '..' are path steps, "
     "not names", openai.BadRequestError),
    ("reserved-id", ReservedSessionId, lambda a, b: _turn(b, RESERVED),
     400, "invalid_request_error", "reserved_session_id", f"invalid session id {RESERVED!r}: ids starting with "
     "'key-' are reserved: each names the session of one API key", openai.BadRequestError),
    ("key-quota", TooManySessions, lambda a, b: _filled(a, b, lambda: a.post("/sessions", cast_to=dict)),
     429, "rate_limit_error", "too_many_sessions", "too many live sessions for this API key (limit 2)",
     openai.RateLimitError),
    ("quota", TooManySessions, lambda a, b: _filled(a, b, lambda: (_turn(b, "p"), _turn(b, "q"))),
     429, "rate_limit_error", "too_many_sessions",
     "too many live sessions (limit 3; this API key holds 1, its fair share among 2 keys is 1)", openai.RateLimitError),
    ("rows", SessionFull, lambda a, b: (_turn(a, "p"), _turn(a, "p"), _turn(a, "p")),  # each turn: a new row
     429, "rate_limit_error", "session_rows_exceeded", "session 'p' holds 2 rows, the most one session may write "
     "(max_session_rows): a turn that starts a new conversation in it is refused; continue one of its "
     "conversations, or end the session and start the new conversation in a new one", openai.RateLimitError),
    ("trainer-behind", TrainerBehind, lambda a, b: _turn(a, "p"),
     429, "rate_limit_error", "trainer_behind", "the trainer is behind: 1 session rows of this proxy wait to be "
     "trained (bound 1); retry the session later", openai.RateLimitError),
]  # fmt: skip


def test_every_session_problem_has_one_answer():
    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    assert set(SESSION_ANSWERS) == subclasses(SessionProblem) - {SessionProblem} == {c[1] for c in PROBLEMS}
    for _, problem, _, status, kind, code, _, _ in PROBLEMS:
        assert SESSION_ANSWERS[problem][:3] == (status, kind, code), problem
    assert all(a.status != 403 for a in SESSION_ANSWERS.values())  # no answer says "exists, not yours"
    assert answer_for(SessionProblem("new")).status == 500  # a problem without a row is the server's own fault
    for module in (
        "sessions",
        "manager",
        "segments",
        "backpressure",
    ):  # the domain speaks no HTTP: no status code, no web framework
        source = (Path(__file__).parent.parent / "areal_core" / "proxy" / f"{module}.py").read_text()
        assert not re.search(r"\b(?:200|[45]\d\d)\b|fastapi|starlette", source), module


@pytest.mark.parametrize("case", PROBLEMS, ids=[c[0] for c in PROBLEMS])
def test_each_session_problem_is_its_status_and_error_type(tok, case, tmp_path):
    _, problem, provoke, status, kind, code, message, sdk_error = case
    limits = ProxyLimits(max_sessions=3, max_sessions_per_key=2, max_session_rows=2)
    admission = None
    if problem is TrainerBehind:  # online mode: one row of this proxy waits, the bound is one
        admission = SessionAdmission(Store(str(tmp_path)), "proxy-0", bound=1, written=1, background=False)
        admission.active = True
    engine = ScriptedEngine(tok, lambda _: "ok")
    app = create_app(engine, tok, api_keys=[KEY_A, KEY_B], limits=limits, admission=admission)
    with ProxyServer(app) as s, pytest.raises(sdk_error) as exc:
        provoke(sdk(s, KEY_A), sdk(s, KEY_B))
    assert exc.value.status_code == status
    assert exc.value.response.json() == {"error": {"message": message, "type": kind, "param": None, "code": code}}
