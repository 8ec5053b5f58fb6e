"""The OpenAI-compatible proxy, driven with the real `openai` SDK over HTTP on 127.0.0.1.

The main episode test uses a real TorchEngine whose tiny model was taught the calculator
tool format (a few seconds of SFT on two problems), so the tool calls are the model's own
tokens; greedy decoding makes the episode deterministic.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model, build_tokenizer, chat_prompt
from areal_core.protocol import decode_shard
from areal_core.proxy.app import create_app
from areal_core.proxy.examples import (
    CALCULATOR_TOOL,
    ScriptedEngine,
    calculate,
    calculator_corpus,
    scripted_calculator_reply,
    sft_calculator,
)
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.segments import discounted_returns, turn_returns
from areal_core.proxy.templating import ChatTemplate, parse_tool_calls
from areal_core.rollout.engine import Generation
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store
from task_data.arithmetic import generate

KEY = "sk-test-proxy"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model is fastest on one thread; with two on a busy 2-core machine it crawls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def task_data():
    train, held_out = generate(0, 60, 10, lo=1, hi=9)
    tok = build_tokenizer(calculator_corpus(train), 300)
    return tok, train


@pytest.fixture(scope="module")
def tool_model(task_data):
    """A tiny Qwen2 taught the calculator episode format on train[0] and train[1]."""
    tok, train = task_data
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model = build_tiny_model(cfg, len(tok), 0)
    loss = sft_calculator(model, tok, train[:2], steps=100, lr=1e-2, batch_size=2)
    assert loss < 0.05
    return model


@pytest.fixture(scope="module")
def real_server(task_data, tool_model):
    tok, _ = task_data
    engine = TorchEngine(tool_model, tok.pad_token_id, tok.eos_token_id, version=7, seed=0)
    app = create_app(engine, tok, api_keys=[KEY, "sk-other"], tool_prompt="none")
    with ProxyServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def scripted_server(task_data):
    tok, _ = task_data
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=3)
    app = create_app(engine, tok, api_keys=[KEY], tool_prompt="full")
    with ProxyServer(app) as server:
        server.engine = engine
        yield server


def end_session(server: ProxyServer, sid: str, key: str = KEY, **body) -> dict:
    r = httpx.post(
        f"{server.base_url}/sessions/{sid}/end",
        headers={"Authorization": f"Bearer {key}"},
        json={"return_trajectory": True, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def assert_trajectory_is_what_was_served(row: dict, turns: list[dict]) -> None:
    """Stored ids == every turn's fed + served ids; loss mask, log-probs and versions line up."""
    ids = row["input_ids"]
    last = turns[-1]
    assert ids == last["prompt_token_ids"] + last["token_ids"]
    expect_mask = [0] * len(ids)
    expect_lp = [0.0] * len(ids)
    expect_ver = [-1] * len(ids)
    for prev, cur in zip(turns, turns[1:]):
        served_so_far = prev["prompt_token_ids"] + prev["token_ids"]
        assert cur["prompt_token_ids"][: len(served_so_far)] == served_so_far  # earlier turns keep exact ids
    for t in turns:
        start = len(t["prompt_token_ids"])
        assert ids[start : start + len(t["token_ids"])] == t["token_ids"]
        for k in range(len(t["token_ids"])):
            expect_mask[start + k] = 1
            expect_lp[start + k] = t["logprobs"][k]
            expect_ver[start + k] = t["versions"][k]
    assert row["loss_mask"] == expect_mask
    assert row["versions"] == expect_ver
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(row["behav_logprobs"], expect_lp))
    assert row["prompt_len"] == len(turns[0]["prompt_token_ids"])


async def calculator_episode(base_url: str, key: str, task: dict, stream: bool = False) -> tuple[list, list[dict]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    messages: list = [{"role": "user", "content": task["prompt"]}]
    extras = []
    for _ in range(4):
        resp = await client.chat.completions.create(
            model="gpt-4o", messages=messages, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=48
        )
        extras.append(resp.areal)
        msg = resp.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            break
        assert resp.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            expr = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
    await client.close()
    return messages, extras


# ---------------------------------------------------------------------------------------------
def test_incremental_template_equals_the_chat_template(task_data):
    tok, train = task_data
    t = ChatTemplate(tok, tool_prompt="none")
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": train[0]["prompt"]},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "and then?"},
    ]
    served = t.render(msgs[:2], generation_prompt=True) + tok.encode("12", add_special_tokens=False) + [t.eos_id]
    pieces = served + t.close_ids(served) + t.delta(msgs[:3], msgs[3:])
    whole = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert pieces == tok.encode(whole, add_special_tokens=False)
    assert t.render(msgs[1:2], generation_prompt=True) == chat_prompt(tok, train[0]["prompt"])


def test_tool_call_convention_parsing():
    out = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>', "c")
    assert out.content == "ok"
    assert out.tool_calls == [
        {"id": "c_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    ]
    assert parse_tool_calls("<tool_call>not json</tool_call>").tool_calls == []
    assert parse_tool_calls("<tool_call>not json</tool_call>").content == "<tool_call>not json</tool_call>"
    both = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c["function"]["name"] for c in both.tool_calls] == ["a", "b"] and both.content is None


def test_models_endpoint(real_server):
    client = openai.OpenAI(base_url=real_server.base_url, api_key=KEY, max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["areal-policy"]
    assert models[0].areal == {"policy_version": 7, "context_tokens": 256}
    # chat serves the policy under any model name, so every name retrieves it (as the name asked)
    for name in ("areal-policy", "gpt-4o", "my-agent-model"):
        card = client.models.retrieve(name)
        assert card.id == name and card.areal == {"policy_version": 7, "context_tokens": 256}


def test_multi_turn_tool_episode_is_stored_byte_for_byte(real_server, task_data, tool_model):
    """Two concurrent calculator episodes (openai SDK, real engine): the model calls the tool, gets
    the result as a tool message and answers; each session's row is exactly what was served."""
    tok, train = task_data
    keys = ["sk-ep-0", "sk-ep-1"]
    for k in keys:
        real_server.app.state.api_keys.add(k)

    async def both():
        return await asyncio.gather(*(calculator_episode(real_server.base_url, k, t) for k, t in zip(keys, train)))

    results = asyncio.run(both())
    for key, task, (messages, extras) in zip(keys, train, results):
        assert len(extras) == 2, "one tool call, then the answer"
        call = messages[1].tool_calls[0]
        assert call.function.name == "calculator"
        worked = task["answer"].split("\n")[0].split("=")[0]
        assert json.loads(call.function.arguments) == {"expression": worked}
        assert messages[2]["content"] == task["meta"]["final"]
        assert messages[-1].content == f"#### {task['meta']['final']}"
        assert {e["session_id"] for e in extras} == {extras[0]["session_id"]} and extras[0]["session_id"].startswith(
            "key-"
        )
        assert all(v == 7 for e in extras for v in e["versions"])
        out = end_session(real_server, extras[0]["session_id"], key, reward=1.0)
        assert len(out["trajectories"]) == 1 and out["rows"][0]["num_turns"] == 2
        row = out["trajectories"][0]
        assert_trajectory_is_what_was_served(row, extras)
        assert row["reward"] == 1.0
        # the row reads as the whole conversation in the chat template, tool result included
        text = tok.decode(row["input_ids"])
        assert text.startswith(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n<tool_call>")
        assert f"<|im_start|>tool\n{task['meta']['final']}<|im_end|>\n" in text
        assert text.endswith(f"<|im_start|>assistant\n#### {task['meta']['final']}<|im_end|>")
        # behaviour log-probs are the model's: one forward pass over the row reproduces them
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(tool_model(input_ids=ids).logits[0].float(), -1)
        for p, m in enumerate(row["loss_mask"]):
            if m:
                assert abs(logp[p - 1, row["input_ids"][p]].item() - row["behav_logprobs"][p]) < 1e-3


class CharEngine:
    """Serves a reply one character per token: ids no tokenizer would produce from the text."""

    def __init__(self, tok, reply: str):
        self.tok, self.reply, self.version = tok, reply, 1
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params):
        ids = [self.tok.encode(c, add_special_tokens=False)[0] for c in self.reply] + [self.eos]
        ids = ids[: params.max_new_tokens]
        return [Generation(list(ids), [-0.5] * len(ids), [1] * len(ids), "stop") for _ in prompts]

    def load_version(self, v):
        pass


def test_served_ids_survive_even_when_retokenising_would_change_them(task_data):
    tok, train = task_data
    reply = "pens now"
    engine = CharEngine(tok, reply)
    app = create_app(engine, tok, api_keys=[KEY])
    with ProxyServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        msgs: list = [{"role": "user", "content": train[0]["prompt"]}]
        extras = []
        for q in ["again", "once more"]:
            r = client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Session-Id": "char"})
            assert r.choices[0].message.content == reply
            extras.append(r.areal)
            msgs += [r.choices[0].message, {"role": "user", "content": q}]
        row = end_session(server, "char")["trajectories"][0]
    assert_trajectory_is_what_was_served(row, extras)
    served = extras[0]["token_ids"][:-1]
    assert tok.encode(reply, add_special_tokens=False) != served  # the text would re-tokenise differently
    assert tok.encode(tok.decode(row["input_ids"]), add_special_tokens=False) != row["input_ids"]


def test_streaming_tool_calls_continue_the_same_trajectory(scripted_server, task_data):
    tok, train = task_data
    task = train[3]
    client = openai.OpenAI(base_url=scripted_server.base_url, api_key=KEY, max_retries=0)
    messages: list = [{"role": "user", "content": task["prompt"]}]
    extras = []
    hdr = {"X-Session-Id": "stream-1"}
    for _ in range(4):
        content, calls, finish, extra = "", {}, None, None
        for chunk in client.chat.completions.create(
            model="m", messages=messages, tools=[CALCULATOR_TOOL], stream=True, extra_headers=hdr
        ):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                calls[tc.index] = tc
            finish = chunk.choices[0].finish_reason or finish
            extra = getattr(chunk, "areal", None) or extra
        extras.append(extra)
        served_text = tok.decode(extra["token_ids"], skip_special_tokens=True)
        if calls:
            assert finish == "tool_calls" and content == ""
            tool_calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls.values()
            ]
            assert served_text.startswith("<tool_call>")
            messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
            for c in tool_calls:
                expr = json.loads(c["function"]["arguments"])["expression"]
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": calculate(expr)})
        else:
            assert finish == "stop" and content == served_text
            break
    assert content == f"#### {task['meta']['final']}"
    assert [e["segment"] for e in extras] == [0] * len(extras)  # the rebuilt messages matched the history
    row = end_session(scripted_server, "stream-1", reward=1.0)["trajectories"][0]
    assert_trajectory_is_what_was_served(row, extras)
    assert tok.decode(row["input_ids"]).startswith("<|im_start|>system\n# Tools\n")  # tool_prompt="full"


def test_completions_endpoint_text_and_token_prompts(real_server, task_data):
    tok, _ = task_data
    client = openai.OpenAI(base_url=real_server.base_url, api_key=KEY, max_retries=0)
    hdr = {"X-Session-Id": "cmpl-1"}
    r1 = client.completions.create(model="m", prompt="Ann has 3 pens", max_tokens=5, logprobs=0, extra_headers=hdr)
    assert r1.choices[0].logprobs.token_logprobs == r1.areal["logprobs"]
    prompt2 = "Ann has 3 pens" + r1.choices[0].text + " so"
    r2 = client.completions.create(model="m", prompt=prompt2, max_tokens=5, extra_headers=hdr)
    ids3 = r2.areal["prompt_token_ids"] + r2.areal["token_ids"] + tok.encode(" ok", add_special_tokens=False)
    r3 = client.completions.create(model="m", prompt=ids3, max_tokens=4, extra_headers=hdr)
    assert r3.areal["prompt_token_ids"] == ids3
    chunks = list(client.completions.create(model="m", prompt="Ben", max_tokens=4, stream=True, extra_headers=hdr))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(
        [t for t in chunks[-1].areal["token_ids"] if t != tok.eos_token_id], skip_special_tokens=True
    )
    out = end_session(real_server, "cmpl-1")
    assert [r["num_turns"] for r in out["rows"]] == [3, 1]  # "Ben" does not extend the first text
    assert_trajectory_is_what_was_served(out["trajectories"][0], [r1.areal, r2.areal, r3.areal])
    assert out["trajectories"][0]["reward"] is None  # no reward given: the row is ungraded


def test_header_sessions_are_separate_and_rewards_discount_backwards(scripted_server, task_data):
    tok, train = task_data
    client = openai.OpenAI(base_url=scripted_server.base_url, api_key=KEY, max_retries=0)
    h = httpx.Client(base_url=scripted_server.base_url, headers={"Authorization": f"Bearer {KEY}"})
    sid = h.post("/sessions", json={}).json()["session_id"]
    other = h.post("/sessions", json={"session_id": "other-1"}).json()["session_id"]
    msgs = {sid: [{"role": "user", "content": train[5]["prompt"]}], other: [{"role": "user", "content": "hi"}]}
    resps = {sid: [], other: []}
    for _ in range(3):  # interleave the two sessions, one key
        for s in (sid, other):
            r = client.chat.completions.create(model="m", messages=msgs[s], extra_headers={"X-Session-Id": s})
            assert r.areal["session_id"] == s
            resps[s].append(r)
            msgs[s] += [r.choices[0].message, {"role": "user", "content": "go on"}]
    assert h.post(f"/sessions/{sid}/reward", json={"reward": 1.0, "turn": 0}).json()["applied_to"] == "turn 0"
    assert h.post(f"/sessions/{sid}/reward", json={"reward": 2.0, "completion_id": resps[sid][1].id}).status_code == 200
    info = h.get(f"/sessions/{sid}").json()
    assert [t["reward"] for t in info["turns"]] == [1.0, 2.0, None]
    out = h.post(f"/sessions/{sid}/end", json={"reward": 4.0, "discount": 0.5, "return_trajectory": True}).json()
    row = out["trajectories"][0]
    # returns, backwards: G2 = 0 + 4 (final) = 4, G1 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3; the row's reward is G0
    assert row["reward"] == 3.0
    for r, g in zip(resps[sid], [3.0, 4.0, 4.0]):
        start = len(r.areal["prompt_token_ids"])
        assert set(row["token_rewards"][start : start + len(r.areal["token_ids"])]) == {g}
    assert sum(1 for g, m in zip(row["token_rewards"], row["loss_mask"]) if g and not m) == 0
    assert_trajectory_is_what_was_served(row, [r.areal for r in resps[sid]])
    assert h.get(f"/sessions/{sid}").status_code == 404  # ended
    other_row = h.post(f"/sessions/{other}/end", json={"return_trajectory": True}).json()["trajectories"][0]
    assert tok.decode(other_row["input_ids"]).startswith("<|im_start|>user\nhi<|im_end|>")
    assert train[5]["prompt"] not in tok.decode(other_row["input_ids"])
    assert_trajectory_is_what_was_served(other_row, [r.areal for r in resps[other]])


@pytest.mark.parametrize(
    "rewards, gamma, returns",
    [
        ([1.0, 0.0, 2.0], 0.5, [1.5, 1.0, 2.0]),  # G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
        ([1.0, -2.0, 0.0, 4.0], 0.5, [0.5, -1.0, 2.0, 4.0]),  # 4; 0 + 2 = 2; -2 + 1 = -1; 1 - 0.5 = 0.5
        ([1.0, 2.0, 3.0], 1.0, [6.0, 5.0, 3.0]),  # γ = 1: the sum of the rewards still to come
        ([1.0, 2.0, 3.0], 0.0, [1.0, 2.0, 3.0]),  # γ = 0: each turn's own reward
        ([4.0], 0.3, [4.0]),  # a single turn: its reward
        ([], 0.5, []),
    ],
)
def test_discounted_returns_by_hand(rewards, gamma, returns):
    assert discounted_returns(rewards, gamma) == returns


def test_turn_returns_count_missing_rewards_as_zero_and_add_the_final_to_the_last_turn():
    assert turn_returns([None, 1.0, None], 2.0, 0.5) == [1.0, 2.0, 2.0]  # rewards [0, 1, 2]
    assert turn_returns([None], 3.0, 0.9) == [3.0]
    assert turn_returns([0.5, None], None, 1.0) == [0.5, 0.0]
    assert turn_returns([None, None], None, 0.5) == []  # no reward at all: ungraded


def test_rewritten_history_opens_a_new_segment(scripted_server):
    client = openai.OpenAI(base_url=scripted_server.base_url, api_key=KEY, max_retries=0)
    hdr = {"X-Session-Id": "rewrite"}
    r1 = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], extra_headers=hdr)
    edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "something else"}]
    r2 = client.chat.completions.create(
        model="m", messages=edited + [{"role": "user", "content": "b"}], extra_headers=hdr
    )
    assert (r1.areal["segment"], r2.areal["segment"]) == (0, 1)
    out = end_session(scripted_server, "rewrite", reward=1.0)
    rows = out["trajectories"]
    assert len(rows) == 2 and all(r["reward"] == 1.0 for r in rows)
    assert sum(rows[1]["loss_mask"]) == len(r2.areal["token_ids"])  # the unserved history is not policy


def test_concurrent_requests_are_batched_into_one_engine_call(task_data):
    tok, train = task_data
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=0)

    async def run():
        app = create_app(engine, tok, api_keys=[KEY])
        with ProxyServer(app) as server:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
            hdrs = [{"X-Session-Id": f"c{i}"} for i in range(24)]
            msgs = [[{"role": "user", "content": train[i]["prompt"]}] for i in range(24)]
            resps = await asyncio.gather(
                *(client.chat.completions.create(model="m", messages=m, extra_headers=h) for m, h in zip(msgs, hdrs))
            )
            await client.close()
            stats = dict(app.state.backend.stats)
            rows = [end_session(server, f"c{i}")["trajectories"][0] for i in range(24)]
        return resps, stats, rows

    resps, stats, rows = asyncio.run(run())
    assert stats["requests"] == 24 and stats["calls"] < 24 and stats["max_batch"] > 1
    for i, (r, row) in enumerate(zip(resps, rows)):
        assert r.areal["session_id"] == f"c{i}"
        assert row["input_ids"] == r.areal["prompt_token_ids"] + r.areal["token_ids"]
        assert train[i]["prompt"] in tok.decode(row["input_ids"])


def test_online_mode_writes_each_ended_session_to_the_store(task_data, tmp_path):
    tok, train = task_data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=2)
    app = create_app(engine, tok, store=store, api_keys=[KEY], worker_id="proxy-t")
    with ProxyServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        extras = {}
        for s in ("graded-1", "ungraded-1"):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": train[0]["prompt"]}], extra_headers={"X-Session-Id": s}
            )
            extras[s] = r.areal
        a = end_session(server, "graded-1", reward=0.5, prompt_id="p0", group_id="g0", meta={"src": "live"})
        b = end_session(server, "ungraded-1")
    assert a["shards"] == ["trajectories/graded/proxy-t/00000000.arrow"]
    assert b["shards"] == ["trajectories/ungraded/proxy-t/00000001.arrow"]
    rows = decode_shard(store.read_bytes(a["shards"][0]))
    assert len(rows) == 1
    s = rows[0]
    assert s.input_ids == extras["graded-1"]["prompt_token_ids"] + extras["graded-1"]["token_ids"]
    assert (s.reward, s.prompt_id, s.group_id, s.meta["src"], s.min_version()) == (0.5, "p0", "g0", "live", 2)
    assert decode_shard(store.read_bytes(b["shards"][0]))[0].reward is None


def test_openapi_description_is_checked_in_and_current():
    from areal_core.proxy.openapi import build_openapi

    spec = build_openapi()
    checked_in = json.loads((ROOT / "docs" / "proxy-openapi.json").read_text())
    assert checked_in == spec, "regenerate: python -m areal_core.proxy.openapi docs/proxy-openapi.json"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/sessions/{session_id}/end"):
        assert path in spec["paths"]
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
