"""The proxy against a hostile client, through a live server with the real `openai` SDK and raw
httpx: a key's implicit session stays within its caps however long a client never ends it (the
rows of each capped session written and counted); session ids that are not names are refused on
every route; a turn is a non-negative integer; and a key cannot tell another key's session from
no session at all: every route answers it with the bytes it answers a missing id with."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import openai
import pytest

from areal_core.models import build_tokenizer
from areal_core.protocol import read_shard_or_quarantine
from areal_core.proxy.app import create_app
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import key_digest, session_id_for_key
from areal_core.store import Store

KEY_A, KEY_B = "sk-hostile-a", "sk-hostile-b"
USER = [{"role": "user", "content": "Ann has 3 pens"}]
BAD_IDS = [".", "..", "a/b", "a\\b", "\x00", "a\x00b", "\x1f", "x" * 129, "y" * 300, "", "ü", "a b"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(["Ann has 3 pens and gets 4 more. How many pens now?", "3+4=7\n#### 7"], 300)


def serve(tok, store: Store | None = None, **limits) -> ProxyServer:
    app = create_app(
        ScriptedEngine(tok, lambda _: "ok"), tok, store=store, api_keys=[KEY_A, KEY_B], limits=ProxyLimits(**limits)
    )
    return ProxyServer(app)


@pytest.fixture(scope="module")
def server(tok) -> Iterator[ProxyServer]:
    with serve(tok) as s:
        yield s


def sdk(server: ProxyServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def http(server: ProxyServer, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def shards_in(store: Store) -> list[str]:
    return [rel for stage in ("graded", "ungraded") for rel in store.find(f"trajectories/{stage}", ".arrow")]


def rows_in(store: Store) -> list:
    return [r for rel in shards_in(store) for r in read_shard_or_quarantine(store, rel)]


# -- the caps on a key's implicit session ------------------------------------------------------------
def test_2000_requests_on_an_implicit_session_stay_within_the_default_segment_cap(tok, tmp_path):
    """A client that never ends its key session and rewrites its history every time (one new segment
    a request: 2,001 segments after 2,000 requests before the cap) holds at most 64 segments live (the
    smaller of max_key_session_segments, 256, and max_session_rows, 64, the row cap of every session);
    each capped session is ended like a normal end, its rows written and counted."""
    store = Store(str(tmp_path / "online"))
    defaults = ProxyLimits()
    cap = min(defaults.max_key_session_segments, defaults.max_session_rows)
    assert (defaults.max_key_session_segments, defaults.max_session_rows, defaults.max_key_session_tokens) == (
        256, 64, 262_144,
    )  # fmt: skip
    n = 2_050
    with serve(tok, store) as s:
        client, c, manager = sdk(s), http(s), s.app.state.sessions
        sid, owner = session_id_for_key(KEY_A), key_digest(KEY_A)
        ended_at, most = [], 0
        for i in range(n):  # the SDK for a cap's worth, then raw httpx (the same requests, half the client time)
            if i < cap + 8:
                areal = client.chat.completions.create(model="m", messages=USER).areal
            else:
                areal = c.post("/chat/completions", json={"model": "m", "messages": USER}).json()["areal"]
            assert areal["session_id"] == sid and areal["segment"] < cap
            live = manager.sessions.get((owner, sid))
            most = max(most, len(live.segments) if live is not None else 0)
            if areal["session_ended"]:
                ended_at.append(i)
                assert areal["segment"] == cap - 1 and (owner, sid) not in manager.sessions
        assert most <= cap
        assert ended_at == [cap * k - 1 for k in range(1, n // cap + 1)]  # the 64th, 128th, ... request
        health = httpx.get(s.url + "/health").json()
        capped = n // cap
        assert health["sessions"]["capped"] == health["sessions"]["ended"] == capped
        assert health["sessions"]["rows_written"] == capped * cap
        assert len(client.get(f"/sessions/{sid}", cast_to=dict)["segments"]) == n - capped * cap
        client.post(f"/sessions/{sid}/end", body={"reward": 1.0}, cast_to=dict)  # the rest, ended by the client
        health = httpx.get(s.url + "/health").json()
    assert health["sessions"]["rows_written"] == n and health["sessions"]["capped"] == capped
    rows = rows_in(store)
    assert len(rows) == n and len({r.sample_id for r in rows}) == n
    assert sum(r.meta.get("capped") == "segments" for r in rows) == capped * cap
    assert {r.reward for r in rows if "capped" not in r.meta} == {1.0}
    assert len(shards_in(store)) == capped + 1  # one shard per ended session (capped: ungraded)


def test_the_token_cap_ends_a_growing_conversation(tok, tmp_path):
    """One ever-longer conversation (one segment) on the key session: the turn that brings it to the
    token cap is its last, said in the response; the session's rows are written, and the next
    request starts a fresh session under the same id."""
    store = Store(str(tmp_path / "online"))
    cap = 120
    with serve(tok, store, max_key_session_tokens=cap) as s:
        client, c = sdk(s), http(s)
        sid = session_id_for_key(KEY_A)
        messages, ends = list(USER), []
        for i in range(12):
            r = client.chat.completions.create(model="m", messages=messages)
            tokens = len(r.areal["prompt_token_ids"]) + len(r.areal["token_ids"])
            if ends and ends[-1][0] == i - 1:  # the request after an end: a fresh session
                assert (r.areal["session_id"], r.areal["turn"]) == (sid, 0)
            if r.areal["session_ended"]:
                ends.append((i, tokens))
                assert tokens >= cap  # ended at the cap, one turn's worth over it at most
                gone = c.post(f"/sessions/{sid}/reward", json={"reward": 1.0})
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"
            else:
                assert tokens < cap
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Ann has 3 pens"}]
        assert ends and httpx.get(s.url + "/health").json()["sessions"]["capped"] == len(ends)
        first = ends[0][0]
    rows = rows_in(store)
    assert len(rows) == len(ends)
    assert rows and all(r.meta["capped"] == "tokens" and len(r.input_ids) >= cap for r in rows)
    assert max(r.num_turns for r in rows) == first + 1


def test_named_sessions_are_not_capped_and_caps_can_be_turned_off(tok):
    with serve(tok, max_key_session_segments=3) as s, serve(tok, max_key_session_segments=None) as off:
        client = sdk(s)
        for _ in range(6):
            named = client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": "mine"})
            assert not named.areal["session_ended"]
        assert named.areal["segment"] == 5  # ended only by its client, or by expiry
        for _ in range(5):
            sdk(off).chat.completions.create(model="m", messages=USER)
        assert len(sdk(off).get(f"/sessions/{session_id_for_key(KEY_A)}", cast_to=dict)["segments"]) == 5
    with pytest.raises(ValueError, match="max_key_session_tokens must be >= 1"):
        serve(tok, max_key_session_tokens=0)


def test_a_request_that_waited_on_a_capped_session_gets_a_fresh_one(tok):
    """Requests race on a key session one turn short of its cap: all are served, no session holds
    more than the cap, and each capped one is ended once."""
    with serve(tok, max_key_session_segments=2) as s:
        client, manager = sdk(s), s.app.state.sessions
        client.chat.completions.create(model="m", messages=USER)
        out: list = []
        threads = [
            threading.Thread(target=lambda: out.append(client.chat.completions.create(model="m", messages=USER)))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == 4 and all(r.areal["segment"] < 2 for r in out)
        counters = manager.counters
        assert counters["capped"] == sum(r.areal["session_ended"] for r in out) == 2  # 5 segments, cap 2
        assert counters["turns"] == 5 and counters["ended"] == counters["capped"]


# -- session ids that are not names --------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD_IDS, ids=[repr(b)[:12] for b in BAD_IDS])
def test_a_session_id_that_is_not_a_name_is_refused_on_every_route(server, bad):
    c = http(server)
    path = quote(bad, safe="").replace(".", "%2E")  # escaped: a client drops literal dot steps
    answers = [
        c.post("/sessions", json={"session_id": bad}),
        c.get(f"/sessions/{path}"),
        c.post(f"/sessions/{path}/reward", json={"reward": 1.0}),
        c.post(f"/sessions/{path}/end", json={}),
    ]
    if bad and all(0x20 < ord(ch) < 0x7F for ch in bad):  # a header can carry it
        answers.append(
            c.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": bad})
        )
        answers.append(c.post("/completions", json={"model": "m", "prompt": "Ann"}, headers={"X-Session-Id": bad}))
    for r in answers:
        assert r.status_code == 400, (r.request.url, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "invalid_session_id", r.text
        assert len(r.content) < 400  # a 300-char id is not echoed whole
    assert not [k for k in server.app.state.sessions.sessions if k[1] == bad]


def test_dot_ids_through_the_sdk(server):
    """A standard client removes `.` and `..` path steps (RFC 3986), so a session by that name could be
    made but never read, rewarded or ended: the proxy refuses to make one."""
    client = sdk(server)
    for bad in (".", ".."):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": bad})
        assert exc.value.body["code"] == "invalid_session_id" and "path steps" in exc.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            client.post("/sessions", body={"session_id": bad}, cast_to=dict)
    with pytest.raises(openai.NotFoundError) as exc:  # what the SDK makes of /sessions/../end: /v1/end
        client.post("/sessions/../end", body={}, cast_to=dict)
    assert exc.value.body["code"] == "not_found"
    ok = client.post("/sessions", body={"session_id": "a...b:c-d_e"}, cast_to=dict)  # every allowed character
    assert ok["session_id"] == "a...b:c-d_e"


# -- turns -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("turn", [-1, -2, -(2**63 - 1), 0.5, 1.0, True, False, "0", [0], {"i": 0}])
def test_a_turn_is_a_non_negative_integer(server, turn):
    client = sdk(server)
    client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": "turns"})
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.post("/sessions/turns/reward", body={"reward": 1.0, "turn": turn}, cast_to=dict)
    assert exc.value.body["code"] == "validation_error" and exc.value.body["param"] == "turn"
    info = client.get("/sessions/turns", cast_to=dict)
    assert all(t["reward"] is None for t in info["turns"]) and info["final_reward"] is None
    assert (
        client.post("/sessions/turns/reward", body={"reward": 1.0, "turn": 0}, cast_to=dict)["applied_to"] == "turn 0"
    )
    client.post("/sessions/turns/end", body={}, cast_to=dict)


# -- another key's session is no session ---------------------------------------------------------------
def _same_length_missing(sid: str) -> str:
    return ("key-" + "0" * (len(sid) - 4)) if sid.startswith("key-") else "z" * len(sid)


def _masked(r: httpx.Response, sid: str) -> tuple[int, bytes, dict]:
    headers = {k: v for k, v in r.headers.items() if k not in ("date",)}
    return r.status_code, r.content.replace(json.dumps(sid).encode()[1:-1], b"<ID>"), headers


REQUESTS = [
    ("read", "GET", "/sessions/{}", None),
    ("read-tokens", "GET", "/sessions/{}?include_tokens=true", None),
    ("reward", "POST", "/sessions/{}/reward", {"reward": 1.0}),
    ("reward-turn", "POST", "/sessions/{}/reward", {"reward": 1.0, "turn": 0}),
    ("reward-turn-5", "POST", "/sessions/{}/reward", {"reward": 1.0, "turn": 5}),
    ("reward-completion", "POST", "/sessions/{}/reward", {"reward": 1.0, "completion_id": "cmpl-x"}),
    ("end", "POST", "/sessions/{}/end", {}),
    ("end-reward", "POST", "/sessions/{}/end", {"reward": 2.0, "return_trajectory": True}),
]


def test_another_keys_session_answers_exactly_as_a_missing_one(server):
    a, b = http(server, KEY_A), http(server, KEY_B)
    named = a.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "secret-1"})
    key_sid = a.post("/chat/completions", json={"model": "m", "messages": USER}).json()["areal"]["session_id"]
    a.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": "gone-1"})
    assert a.post("/sessions/gone-1/end", json={}).status_code == 200
    assert named.status_code == 200 and key_sid == session_id_for_key(KEY_A)
    before = {sid: a.get(f"/sessions/{sid}", params={"include_tokens": True}).json() for sid in ("secret-1", key_sid)}
    for sid in ("secret-1", key_sid, "gone-1"):
        missing = _same_length_missing(sid)
        for name, method, path, body in REQUESTS:
            theirs = b.request(method, path.format(sid), json=body)
            none = b.request(method, path.format(missing), json=body)
            assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "unknown_session", (name, sid)
            assert _masked(theirs, sid) == _masked(none, missing), (name, sid)
        with pytest.raises(openai.NotFoundError) as theirs_exc:
            sdk(server, KEY_B).post(f"/sessions/{sid}/end", body={"reward": 1.0}, cast_to=dict)
        with pytest.raises(openai.NotFoundError) as none_exc:
            sdk(server, KEY_B).post(f"/sessions/{missing}/end", body={"reward": 1.0}, cast_to=dict)
        assert theirs_exc.value.body == {**none_exc.value.body, "message": f"no live session {sid!r}"}
    after = {sid: a.get(f"/sessions/{sid}", params={"include_tokens": True}).json() for sid in ("secret-1", key_sid)}
    assert after == before  # untouched by B
    # the same name through chat is B's own, new session: turn 0 whether or not A has one
    for sid in ("secret-1", "never-1"):
        r = sdk(server, KEY_B).chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": sid})
        assert (r.areal["turn"], r.areal["segment"]) == (0, 0)
    assert a.get("/sessions/secret-1", params={"include_tokens": True}).json() == before["secret-1"]


def test_another_keys_key_id_is_refused_alike_whether_or_not_it_is_in_use(server):
    """Opening a key-derived id that is not one's own is refused by the id's form: the same answer for
    a live session of another key, one it ended, and an id no key has."""
    a, b = http(server, KEY_A), http(server, KEY_B)
    live = a.post("/chat/completions", json={"model": "m", "messages": USER}).json()["areal"]["session_id"]
    nobody = "key-" + "f" * 24
    answers = []
    for sid in (live, nobody):
        for r in (
            b.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": sid}),
            b.post("/completions", json={"model": "m", "prompt": "Ann"}, headers={"X-Session-Id": sid}),
            b.post("/sessions", json={"session_id": sid}),
        ):
            assert r.status_code == 400 and r.json()["error"]["code"] == "reserved_session_id", r.text
            answers.append(_masked(r, sid))
    assert answers[:3] == answers[3:]
    assert a.post(f"/sessions/{live}/end", json={}).status_code == 200
    ended = b.post("/sessions", json={"session_id": live})
    assert _masked(ended, live) == answers[2]
    with pytest.raises(openai.BadRequestError):
        sdk(server, KEY_B).chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": live})
    own = session_id_for_key(KEY_B)  # a key may name its own key session
    assert b.post("/chat/completions", json={"model": "m", "messages": USER}, headers={"X-Session-Id": own}).is_success
