"""Issue 46, admission that bounds rows, not sessions: a session writes at most `max_session_rows`
rows (a turn starting one more is a 429 `session_rows_exceeded` the SDK does not retry), open
sessions hold max(1, their rows) of the trainer's bound, so waiting rows stay ≤ bound +
(max_session_rows − 1) × the sessions open at the bound; and no key can lock another out of a full
session table: a key's implicit session is always opened, and a key below its fair share takes the
place of an idle session of the key holding the most above its own. Through the real proxy app over
HTTP with the openai SDK; the trainer is a `trainer/live_settled.json` that never advances."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from areal_core.layout import LAYOUT
from areal_core.models import build_tokenizer
from areal_core.proxy.app import create_app
from areal_core.proxy.backpressure import SessionAdmission
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.manager import SessionManager
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import TooManySessions, session_id_for_key
from areal_core.store import Store

KEYS = ["sk-ann", "sk-bob", "sk-cat", "sk-dan"]
ANN, BOB, CAT, DAN = KEYS


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(["Ann has 3 pens and gets 4 more. How many pens now?", "3+4=7\n#### 7"], 300)


def sdk(server: ProxyServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def http(server: ProxyServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def ask(client: openai.OpenAI, sid: str | None, text: str, history: list[dict] | None = None) -> dict:
    """One chat turn (a new conversation unless `history` continues one); its `areal` object."""
    headers = {"X-Session-Id": sid} if sid is not None else {}
    messages = [*(history or []), {"role": "user", "content": text}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=4, extra_headers=headers)
    return {**r.areal, "reply": {"role": "assistant", "content": r.choices[0].message.content}}


def online(tmp_path, bound: int) -> tuple[Store, SessionAdmission]:
    """A run root whose continuous trainer has settled nothing, and the proxy's admission over it."""
    store = Store(str(tmp_path / "run"))
    store.write_json(LAYOUT.live_settled, {"rows": {}})
    adm = SessionAdmission(store, "proxy-0", bound=bound, written=0, background=False)
    adm.refresh()  # read once: the trainer never advances in these tests
    assert adm.active
    return store, adm


def serve(tok, limits: ProxyLimits, store: Store | None = None, admission: SessionAdmission | None = None):
    engine = ScriptedEngine(tok, lambda _: "ok")
    return ProxyServer(create_app(engine, tok, store=store, api_keys=KEYS, limits=limits, admission=admission))


def fill(client: openai.OpenAI, sid: str, start: int = 0) -> tuple[int, int]:
    """New conversations in session `sid` until the row cap refuses one: (served, refused: 1)."""
    served = 0
    for i in range(start, start + 100):
        try:
            ask(client, sid, f"Ann has {i} pens")
        except openai.RateLimitError as exc:
            assert exc.code == "session_rows_exceeded", exc.message
            return served, 1
        served += 1
    return served, 0


# -- (a) fair sharing of max_sessions ---------------------------------------------------------
def test_two_keys_filling_the_table_lock_no_third_key_out(tok):
    """max_sessions 4: Ann and Bob hold two each. Cat still opens a named session (in place of the
    least recently used idle session of a key above its fair share, 4 // 3 = 1) and its implicit
    session (never refused by a quota); Dan gets in the same way. A key at its share is refused with a
    429 in the OpenAI error shape saying so; its implicit session is still served."""
    with serve(tok, ProxyLimits(max_sessions=4, max_sessions_per_key=4)) as s:
        ann, bob, cat, dan = (sdk(s, k) for k in KEYS)
        for client, sids in ((ann, ("a1", "a2")), (bob, ("b1", "b2"))):
            for sid in sids:
                ask(client, sid, "Ann has 3 pens")
        assert ask(cat, "c1", "Ann has 3 pens")["turn"] == 0  # the old proxy: 429 too_many_sessions
        implicit = ask(cat, None, "Ann has 3 pens")
        assert implicit["session_id"] == session_id_for_key(CAT)
        assert http(s, ANN).get("/sessions/a1").status_code == 404  # the oldest idle session gave its place
        assert http(s, ANN).get("/sessions/a2").status_code == 200
        assert ask(dan, "d1", "Ann has 3 pens")["turn"] == 0
        assert http(s, BOB).get("/sessions/b1").status_code == 404  # Bob held the most above his share
        with pytest.raises(openai.RateLimitError) as refused:
            ask(ann, "a3", "Ann has 3 pens")  # Ann holds 1, her share among 4 keys
        assert refused.value.code == "too_many_sessions" and refused.value.body["type"] == "rate_limit_error"
        assert "this API key holds 1, its fair share among 4 keys is 1" in refused.value.message
        assert refused.value.response.headers["retry-after"] == "1"
        assert ask(ann, None, "Ann has 3 pens")["session_id"] == session_id_for_key(ANN)  # always served
        assert (
            ask(cat, None, "Ann has 4 pens", [{"role": "user", "content": "Ann has 3 pens"}, implicit["reply"]])["turn"]
            == 1
        )  # Cat's implicit session was never evicted
        health = httpx.get(s.url + "/health", timeout=60).json()
        assert health["sessions"]["evicted"] == 2 and health["live_sessions"] == 6  # 4 + two implicit sessions


def test_a_key_s_implicit_session_is_served_past_its_own_quota(tok):
    with serve(tok, ProxyLimits(max_sessions=10, max_sessions_per_key=2)) as s:
        ann = sdk(s, ANN)
        ask(ann, "a1", "Ann has 3 pens")
        ask(ann, "a2", "Ann has 3 pens")
        with pytest.raises(openai.RateLimitError) as refused:
            ask(ann, "a3", "Ann has 3 pens")
        assert "too many live sessions for this API key (limit 2)" in refused.value.message
        assert ask(ann, None, "Ann has 3 pens")["session_id"] == session_id_for_key(ANN)


def test_a_session_with_a_request_in_flight_is_never_evicted():
    """The table is full of Ann's sessions; with every one of them busy, Bob (below his share) is
    refused (a 429 worth retrying), and once one is idle he takes its place."""

    async def scenario() -> None:
        manager = SessionManager(template=None, max_sessions=2, max_sessions_per_key=5)
        busy = [manager.open(sid, "ann") for sid in ("a1", "a2")]
        for s in busy:
            await s.lock.acquire()
        with pytest.raises(TooManySessions, match="this API key holds 0, its fair share among 2 keys is 1"):
            manager.open("b1", "bob")
        busy[1].lock.release()
        assert manager.open("b1", "bob").owner == "bob"
        assert busy[1].ended and not busy[0].ended and manager.counters["evicted"] == 1
        assert manager.held_rows == 2

    asyncio.run(scenario())


# -- (b) a per-session row cap, and waiting rows ≤ bound + slack ------------------------------
def test_one_session_s_rows_stop_at_the_cap_and_waiting_rows_stay_within_bound_plus_slack(tok, tmp_path):
    """Bound 8 rows, max_session_rows 4, the trainer settles nothing. One session starting ten
    conversations gets four: the other six are 429 `session_rows_exceeded` (x-should-retry: false,
    so the SDK does not retry them) while a turn continuing one of its conversations is served; its
    end writes 4 rows. Then sessions open until the bound refuses one (4 rows wait, 4 sessions open
    hold 4), each writes rows up to its cap, and all end: waiting rows 20 = bound + (4 − 1) × 4."""
    cap, bound = 4, 8
    store, adm = online(tmp_path, bound)
    limits = ProxyLimits(max_session_rows=cap)
    with serve(tok, limits, store, adm) as s:
        ann, h = sdk(s, ANN), http(s, ANN)
        first = ask(ann, "long", "Ann has 0 pens")
        served, refused = 1, 0
        for i in range(1, 10):
            try:
                ask(ann, "long", f"Ann has {i} pens")
                served += 1
            except openai.RateLimitError as exc:
                refused += 1
                assert exc.status_code == 429 and exc.code == "session_rows_exceeded"
                assert exc.body["type"] == "rate_limit_error" and "holds 4 rows" in exc.message
                assert exc.response.headers["x-should-retry"] == "false" and "retry-after" not in exc.response.headers
        assert (served, refused) == (cap, 10 - cap)  # the old proxy served all ten
        assert (
            ask(ann, "long", "Ann has 9 pens", [{"role": "user", "content": "Ann has 0 pens"}, first["reply"]])["turn"]
            == cap
        )  # a turn continuing a conversation adds no row: served
        ended = h.post("/sessions/long/end", json={"reward": 1.0}).json()
        assert len(ended["rows"]) == cap and ended["turns"] == cap + 1
        assert adm.waiting() == cap

        opened = []
        for k in range(bound + 5):  # sessions open until the bound refuses one
            try:
                ask(ann, f"s{k}", "Ann has 3 pens")
            except openai.RateLimitError as exc:
                assert exc.code == "trainer_behind"
                break
            opened.append(f"s{k}")
        assert len(opened) == bound - cap  # 4 rows wait, each open session holds one
        for sid in opened:
            assert fill(ann, sid, start=100) == (cap - 1, 1)  # to its cap, then refused
        health = httpx.get(s.url + "/health", timeout=60).json()["admission"]
        assert health["held_rows"] == cap * len(opened)
        with pytest.raises(openai.RateLimitError, match="20 session rows"):
            ask(ann, "late", "Ann has 3 pens")
        for sid in opened:
            assert len(h.post(f"/sessions/{sid}/end", json={"reward": 0.0}).json()["rows"]) == cap
        slack = (cap - 1) * len(opened)
        assert adm.waiting() == bound + slack == 20


def test_rows_held_by_open_sessions_count_against_the_bound(tok, tmp_path):
    """Bound 8, nothing written yet: one session starting four conversations holds four rows of the
    bound, so four more sessions open and the sixth is refused (the old proxy counted it one row and
    opened seven)."""
    store, adm = online(tmp_path, 8)
    with serve(tok, ProxyLimits(max_session_rows=4), store, adm) as s:
        ann = sdk(s, ANN)
        assert fill(ann, "big") == (4, 1)
        opened = 0
        for k in range(10):
            try:
                ask(ann, f"s{k}", "Ann has 3 pens")
            except openai.RateLimitError as exc:
                assert exc.code == "trainer_behind" and "8 session rows of this proxy wait" in exc.message
                break
            opened += 1
        assert opened == 4


def test_a_key_s_implicit_session_is_ended_at_the_row_cap_and_goes_on_in_a_fresh_one(tok, tmp_path):
    """The implicit session cannot be ended by its client: at max_session_rows (below
    max_key_session_segments) the turn that reached the cap is its last, its rows are written, and the
    next request opens a fresh one (which the trainer's bound admits like any new session)."""
    store, adm = online(tmp_path, 100)
    with serve(tok, ProxyLimits(max_session_rows=3, max_key_session_segments=256), store, adm) as s:
        ann = sdk(s, ANN)
        ended = [ask(ann, None, f"Ann has {i} pens")["session_ended"] for i in range(4)]
        assert ended == [False, False, True, False]
        health = httpx.get(s.url + "/health", timeout=60).json()
        assert health["sessions"]["capped"] == 1 and health["sessions"]["rows_written"] == 3 == adm.waiting()


def test_the_row_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_session_rows must be >= 1"):
        SessionManager(template=None, max_session_rows=0)


def test_held_rows_are_given_back_when_sessions_end_or_expire(tok, tmp_path):
    store, adm = online(tmp_path, 100)
    with serve(tok, ProxyLimits(max_session_rows=8), store, adm) as s:
        ann, h = sdk(s, ANN), http(s, ANN)
        assert fill(ann, "x") == (8, 1)
        ask(ann, "y", "Ann has 3 pens")
        manager = s.app.state.sessions
        assert manager.held_rows == 9
        h.post("/sessions/x/end", json={})
        assert manager.held_rows == 1
        manager.session_ttl_s = 0.0
        manager._sweep()  # y has been idle for longer than a TTL of 0
        assert manager.held_rows == 0 and manager.counters["expired"] == 1
        assert adm.waiting() == 8  # x's rows; y expired unwritten


# -- (c) a normal workload under the bound is unaffected ---------------------------------------
def test_a_normal_workload_under_the_bound_is_unaffected(tok, tmp_path):
    """Three keys, two multi-turn sessions each (every turn continues its conversation) and one
    implicit session each, well under every limit: all served, one row per session, no refusal and
    no eviction; the rows waiting are exactly the rows written."""
    store, adm = online(tmp_path, 64)
    with serve(tok, ProxyLimits(max_sessions=16, max_sessions_per_key=4), store, adm) as s:
        for key in KEYS[:3]:
            client, h = sdk(s, key), http(s, key)
            for sid in (None, "task-1", "task-2"):
                history: list[dict] = []
                for t in range(3):
                    out = ask(client, sid, f"Ann has {t} pens", history)
                    assert out["turn"] == t and out["segment"] == 0
                    history += [{"role": "user", "content": f"Ann has {t} pens"}, out["reply"]]
            for sid in ("task-1", "task-2", session_id_for_key(key)):
                assert len(h.post(f"/sessions/{sid}/end", json={"reward": 1.0}).json()["rows"]) == 1
        health = httpx.get(s.url + "/health", timeout=60).json()
        assert health["sessions"]["evicted"] == 0 and health["sessions"]["turns"] == 27
        assert health["admission"] == {
            "active": True, "waiting_rows": 9, "held_rows": 0, "bound": 64, "refused_sessions": 0,
        }  # fmt: skip
        assert health["sessions"]["rows_written"] == 9 and health["live_sessions"] == 0
