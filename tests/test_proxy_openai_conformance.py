"""The proxy against OpenAI's request contract, through a live server with the real `openai` SDK and
raw HTTP: JSON nested too deeply or breaking strict JSON inside tool-call arguments is a 4xx, never a
500; a body without a content type is read as JSON, as documented; a reward is a JSON number naming
one turn; options the engine cannot honour (top log-probs, response formats, forced tool choices,
penalties, logit_bias, suffix, best_of) are refused instead of ignored; and a stream carries the
log-probs the non-streaming answer does."""

from __future__ import annotations

import json
from http.client import HTTPConnection

import openai
import pydantic
import pytest

from areal_core.proxy.app import create_app
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.strictjson import MAX_JSON_DEPTH
from areal_core.proxy.templating import ChatTemplate, TemplateError
from tests.test_proxy_hostile import KEY_A, USER, http, sdk, server, tok  # noqa: F401 - pytest fixtures

CHAT, CMPL = "/chat/completions", "/completions"
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}


def nested(depth: int) -> str:
    """A JSON object `depth` levels deep: {"a": {"a": ... 1}}."""
    return '{"a": ' * depth + "1" + "}" * depth


def with_call(arguments) -> list[dict]:
    """USER, an assistant tool call with `arguments`, and its result."""
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "7"}
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, result]


def post_raw(server: ProxyServer, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:  # noqa: F811
    """A POST with exactly these headers (httpx and the SDK add a content type)."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1" + path, body=body, headers={"Authorization": f"Bearer {KEY_A}", **(headers or {})})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def assert_error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


# -- strict JSON everywhere: no 500 -----------------------------------------------------------------
@pytest.mark.parametrize(
    "arguments, reason",
    [
        ("[" * 1000 + "]" * 1000, "nested more than"),  # json.loads: RecursionError, a 500
        ('{"x": "\\ud800"}', "lone surrogate"),  # json.loads brings the surrogate back: tokenizers' TypeError
        ("1" + "0" * 5000, "64-bit range"),  # int(): a ValueError about sys.set_int_max_str_digits
        ('{"a": ' + "9" * 30 + "}", "64-bit range"),  # an id-heavy agent's history from another model
        ('{"x": NaN}', "not a JSON number"),
    ],
    ids=["nested-1000", "lone-surrogate", "bigint", "bigint-in-object", "nan"],
)
def test_tool_call_arguments_that_break_strict_json_are_served_as_their_text(server, arguments, reason):  # noqa: F811
    """Each of these was a 500 (or a mislabelled 400); parsed strictly they are refused, so the
    template renders the text the client sent, as it is, and the request is served."""
    from areal_core.proxy import strictjson
    from areal_core.proxy.templating import _arguments_obj

    with pytest.raises(ValueError, match=reason):
        strictjson.loads(arguments)
    assert _arguments_obj(arguments) == arguments
    r = http(server).post(CHAT, json={"model": "m", "messages": with_call(arguments), "max_tokens": 2})
    if len(arguments) > 4096:  # rendered as text it is longer than the context: said so, not a 500
        assert_error(r, 400, "context_length_exceeded")
        return
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_the_depth_is_read_off_the_brackets_before_any_parser_recurses(monkeypatch):
    """`nested_deeper_than` agrees with the depth of the parsed value on random JSON whose strings are full of
    brackets, quotes and backslashes; 100,000 levels are refused without recursing (json.loads met the stack
    limit at ~1,000, where a finalizer's warning then failed to print: a flaky unraisable-exception error)."""
    import random
    import sys

    from areal_core.proxy.strictjson import TooDeep, depth_of, loads, nested_deeper_than

    rng = random.Random(0)

    def text() -> str:
        return "".join(rng.choice(["[", "]", "{", "}", '"', "\\", "a", " ", "é"]) for _ in range(rng.randint(0, 8)))

    def value(depth: int):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([text(), 1, None, 2.5])
        if rng.random() < 0.5:
            return [value(depth - 1) for _ in range(rng.randint(0, 3))]
        return {text(): value(depth - 1) for _ in range(rng.randint(0, 3))}

    for _ in range(500):
        obj = value(rng.randint(0, 12))
        encoded = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
        depth = depth_of(obj, 10**6)
        for limit in (0, 1, 3, 8, 12):
            assert nested_deeper_than(encoded, limit) == (depth > limit), (encoded, limit)
            assert nested_deeper_than(encoded.encode(), limit) == (depth > limit)
    import areal_core.proxy.strictjson as strictjson

    parse = strictjson.json.loads
    monkeypatch.setattr(strictjson.json, "loads", lambda t, **k: parse(t, **k) if len(t) < 1000 else pytest.fail(t))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a stack this shallow still refuses the deepest text: no parser sees it
    try:
        for deep in ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000, "[" * 100_000]:
            with pytest.raises(TooDeep, match=f"nested more than {MAX_JSON_DEPTH} levels"):
                loads(deep)
    finally:
        sys.setrecursionlimit(limit)
    assert loads('["[[[[", {"]}": "\\"[["}]') == ["[[[[", {"]}": '"[['}]  # brackets in strings are text


@pytest.mark.parametrize("where", ["tool-parameters", "arguments-object", "extra-field"])
def test_nesting_past_the_depth_cap_is_a_422_before_any_handler(server, where):  # noqa: F811
    deep = json.loads(nested(500))  # 500 levels passed json.loads and failed the chat template with a 500
    body: dict = {"model": "m", "messages": USER}
    if where == "tool-parameters":
        body["tools"] = [{"type": "function", "function": {"name": "c", "parameters": deep}}]
    elif where == "arguments-object":
        body["messages"] = with_call(deep)
    else:
        body["unused"] = deep
    status, payload = post_raw(server, CHAT, json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 422 and payload["error"]["code"] == "validation_error", payload
    assert f"nested more than {MAX_JSON_DEPTH} levels" in payload["error"]["message"]


def test_the_depth_cap_counts_every_level_of_the_body(server):  # noqa: F811
    def body(depth: int) -> bytes:  # the body object is level 1, "x" holds the rest
        head = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
        return head + nested(depth - 1).encode() + b"}"

    assert post_raw(server, CHAT, body(MAX_JSON_DEPTH))[0] == 200
    status, payload = post_raw(server, CHAT, body(MAX_JSON_DEPTH + 1))
    assert status == 422 and payload["error"]["code"] == "validation_error"


def test_a_template_that_runs_out_of_stack_is_a_template_error(tok):  # noqa: F811
    """Past the guard (a caller of ChatTemplate), a RecursionError in Jinja is a 400, not a 500."""
    template = ChatTemplate(tok)
    tools = [{"type": "function", "function": {"name": "c", "parameters": json.loads(nested(900))}}]
    with pytest.raises(TemplateError, match="nested too deeply"):
        template.render(USER, tools, generation_prompt=True)


# -- content type -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "", " ;charset=utf-8"], ids=["absent", "empty", "no-media"])
def test_a_json_body_without_a_content_type_is_read_as_json(server, content_type):  # noqa: F811
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps({"model": "m", "messages": USER, "max_tokens": 2}).encode()
    status, payload = post_raw(server, CHAT, body, headers)
    assert status == 200, payload
    assert payload["choices"][0]["message"]["content"] == "ok"


def test_a_whitespace_body_names_no_param(server):  # noqa: F811
    status, payload = post_raw(server, CHAT, b"   ", {"Content-Type": "application/json"})
    assert status == 422 and payload["error"]["code"] == "validation_error"
    assert payload["error"]["param"] is None  # was "3", the offset of the JSON error


# -- rewards -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("reward", ["1.0", True, "1"], ids=["string", "bool", "int-string"])
def test_a_reward_is_a_json_number_only(server, reward):  # noqa: F811
    client = sdk(server)
    client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Session-Id": "rw-strict"})
    for path in ("/sessions/rw-strict/reward", "/sessions/rw-strict/end"):
        r = http(server).post(path, json={"reward": reward})
        assert_error(r, 422, "validation_error")
        assert r.json()["error"]["param"] == "reward"
    ok = http(server).post("/sessions/rw-strict/reward", json={"reward": 1})  # an integer is a number
    assert ok.status_code == 200 and ok.json()["reward"] == 1.0
    http(server).post("/sessions/rw-strict/end", json={})


def test_a_reward_naming_two_different_turns_is_refused(server):  # noqa: F811
    client, h = sdk(server), {"X-Session-Id": "rw-two"}
    first = client.chat.completions.create(model="m", messages=USER, extra_headers=h)
    again = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    client.chat.completions.create(model="m", messages=again, extra_headers=h)
    r = http(server).post("/sessions/rw-two/reward", json={"reward": 2.0, "turn": 1, "completion_id": first.id})
    error = assert_error(r, 400, "turn_mismatch")
    assert "completion_id is turn 0" in error["message"] and "not turn 1" in error["message"]
    turns = http(server).get("/sessions/rw-two").json()["turns"]
    assert [t["reward"] for t in turns] == [None, None]  # nothing was applied
    same = http(server).post("/sessions/rw-two/reward", json={"reward": 2.0, "turn": 0, "completion_id": first.id})
    assert same.status_code == 200 and same.json()["applied_to"] == "turn 0"
    http(server).post("/sessions/rw-two/end", json={})


# -- options the engine cannot honour are refused -----------------------------------------------------
FN = {"type": "function", "function": {"name": "calculator"}}
ALLOWED = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [FN]}}
# (route, an option the engine cannot honour, its code, the nearest form of it that is served)
REFUSED = [
    (CHAT, {"logprobs": True, "top_logprobs": 3}, "unsupported_top_logprobs", {"logprobs": True, "top_logprobs": 0}),
    (CHAT, {"top_logprobs": 0}, "invalid_top_logprobs", {"logprobs": True}),  # OpenAI: needs logprobs: true
    (CHAT, {"logprobs": False, "top_logprobs": 2}, "invalid_top_logprobs", {"logprobs": False}),
    (CMPL, {"logprobs": 1}, "unsupported_top_logprobs", {"logprobs": 0}),  # logprobs 1 gave [{}] as top_logprobs
    (CMPL, {"logprobs": 5}, "unsupported_top_logprobs", {"logprobs": 0}),
    (CHAT, {"response_format": {"type": "json_object"}}, "unsupported_response_format",
     {"response_format": {"type": "text"}}),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "unsupported_response_format",
     {"response_format": {"type": "text"}}),
    (CHAT, {"tool_choice": "required"}, "invalid_tool_choice", {"tool_choice": "auto"}),  # no tools
    (CHAT, {"tool_choice": FN}, "invalid_tool_choice", {"tool_choice": "none"}),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_tool_choice",
     {"tools": [TOOL], "tool_choice": "auto"}),
    (CHAT, {"tools": [TOOL], "tool_choice": "required"}, "unsupported_tool_choice",
     {"tools": [TOOL], "tool_choice": "auto"}),
    (CHAT, {"tools": [TOOL], "tool_choice": FN}, "unsupported_tool_choice", {"tools": [TOOL], "tool_choice": "none"}),
    (CHAT, {"tools": [TOOL], "tool_choice": ALLOWED}, "unsupported_tool_choice",
     {"tools": [TOOL], "tool_choice": "auto"}),
    (CHAT, {"frequency_penalty": 0.5}, "unsupported_penalty", {"frequency_penalty": 0}),
    (CHAT, {"presence_penalty": -1.0}, "unsupported_penalty", {"presence_penalty": 0.0}),
    (CMPL, {"frequency_penalty": 1.0}, "unsupported_penalty", {"frequency_penalty": 0.0}),
    (CHAT, {"logit_bias": {"5": 10}}, "unsupported_logit_bias", {"logit_bias": {}}),
    (CMPL, {"logit_bias": {"5": -100}}, "unsupported_logit_bias", {"logit_bias": None}),
    (CMPL, {"suffix": "end"}, "unsupported_suffix", {"suffix": ""}),
    (CMPL, {"best_of": 2}, "unsupported_best_of", {"best_of": 1}),
]  # fmt: skip


def request(path: str, **extra) -> dict:
    prompt = {"messages": USER} if path == CHAT else {"prompt": "Ann has"}
    return {"model": "m", **prompt, "max_tokens": 2, **extra}


@pytest.mark.parametrize("path, extra, code, served", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_an_option_the_engine_cannot_honour_is_a_400_and_its_honoured_form_is_served(
    server,  # noqa: F811
    path,
    extra,
    code,
    served,
):
    assert_error(http(server).post(path, json=request(path, **extra)), 400, code)
    r = http(server).post(path, json=request(path, **served))
    assert r.status_code == 200, r.text


def test_a_seed_is_any_int64(server):  # noqa: F811
    for seed in (-(2**63), 2**63 - 1):  # the least was refused: the guard compared abs() with 2**63 - 1
        r = http(server).post(CHAT, json=request(CHAT, seed=seed))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "extra",
    [
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
        {"response_format": {"type": "xml"}},
        {"response_format": "json_object"},
        {"tool_choice": "always"},
        {"tool_choice": {"type": "function"}},
        {"logit_bias": {"5": "a lot"}},
    ],
)
def test_an_invalid_option_value_is_a_422(server, extra):  # noqa: F811
    error = assert_error(http(server).post(CHAT, json=request(CHAT, **extra)), 422, "validation_error")
    assert error["param"].split(".")[0] == next(iter(extra))


def test_the_sdk_sees_the_refusals(server):  # noqa: F811
    client = sdk(server)

    class Answer(pydantic.BaseModel):
        answer: int

    with pytest.raises(openai.BadRequestError) as exc:  # was a plain-text answer the SDK then failed to parse
        client.beta.chat.completions.parse(model="m", messages=USER, response_format=Answer)
    assert exc.value.body["code"] == "unsupported_response_format"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2)
    assert exc.value.body["code"] == "unsupported_top_logprobs"


def test_forced_sampling_ignores_the_request_penalties_as_it_does_temperature(tok):  # noqa: F811
    app = create_app(ScriptedEngine(tok, lambda _: "ok"), tok, api_keys=[KEY_A], force_sampling=True)
    with ProxyServer(app) as srv:
        r = http(srv).post(CHAT, json=request(CHAT, presence_penalty=1.0, logit_bias={"5": 3}))
        assert r.status_code == 200, r.text
        assert_error(http(srv).post(CHAT, json=request(CHAT, response_format={"type": "json_object"})), 400,
                     "unsupported_response_format")  # fmt: skip
        # an agent's tool_choice (LangChain's bind_tools(tool_choice="any") sends "required") is ignored
        # in training like its other sampling options; one naming no tool is still refused
        for choice in ("required", FN, ALLOWED):
            r = http(srv).post(CHAT, json=request(CHAT, tools=[TOOL], tool_choice=choice))
            assert r.status_code == 200, r.text
        bad = {"type": "function", "function": {"name": "nope"}}
        assert_error(
            http(srv).post(CHAT, json=request(CHAT, tools=[TOOL], tool_choice=bad)), 400, "invalid_tool_choice"
        )


# -- streaming log-probs ------------------------------------------------------------------------------
def test_a_chat_stream_carries_each_tokens_logprob_once(server):  # noqa: F811
    client = sdk(server)
    chunks = list(client.chat.completions.create(model="m", messages=USER, logprobs=True, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    areal = next(c.areal for c in chunks if getattr(c, "areal", None))
    assert [e.logprob for e in entries] == areal["logprobs"] and entries  # every served token, in order
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content_chunks and all(c.choices[0].logprobs.content for c in content_chunks)
    whole = client.chat.completions.create(model="m", messages=USER, logprobs=True)
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    plain = list(client.chat.completions.create(model="m", messages=USER, stream=True))
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)  # not asked: none


def test_a_completions_stream_carries_the_legacy_logprobs(server):  # noqa: F811
    client = sdk(server)
    chunks = list(client.completions.create(model="m", prompt="Ann has", logprobs=0, stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    areal = next(c.areal for c in chunks if getattr(c, "areal", None))
    assert [x for lp in lps for x in lp.token_logprobs] == areal["logprobs"]
    whole = client.completions.create(model="m", prompt="Ann has", logprobs=0)
    assert [x for lp in lps for x in lp.text_offset] == whole.choices[0].logprobs.text_offset
    assert [x for lp in lps for x in lp.tokens] == whole.choices[0].logprobs.tokens


# -- messages ----------------------------------------------------------------------------------------
def test_a_text_part_without_text_says_so(server):  # noqa: F811
    r = http(server).post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    error = assert_error(r, 400, "invalid_messages")
    assert 'needs a string "text"' in error["message"]


# -- log-prob bytes --------------------------------------------------------------------------------
TEXTS = ["né 😀 ok — 日本語", "pens: 3+4=7", "\u00e9\u0301 ✓"]


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_each_tokens_bytes_are_its_raw_bytes_and_join_to_the_text(which, request, tok):  # noqa: F811
    """A token that is part of a UTF-8 character decodes alone to U+FFFD; its `bytes` must be the
    token's own bytes, so a client rebuilds the text from them (OpenAI's contract)."""
    from transformers import AutoTokenizer

    from areal_core.proxy.decoding import token_bytes, token_logprobs
    from areal_core.rollout.engine import Generation

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path")) if which == "smollm2" else tok
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tokenizer, t) for t in ids) == text.encode()
        entries = token_logprobs(tokenizer, Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop"))
        assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
        if which == "smollm2" and "😀" in text:  # the emoji's four bytes span two tokens here
            assert any(e["token"] == "\ufffd" and e["bytes"] != list("\ufffd".encode()) for e in entries)
