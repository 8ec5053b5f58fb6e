"""Bytes from the network at the edges (issue 54, docs/security.md "Models, proxy, MCP and sandbox"):
a chat request's tool list, a vLLM server's generate response and an MCP server's tool list are
bounded and checked before they become a prompt or a sample; each test fails without its guard.

Run as `python tests/test_security_edges.py flood|deep` this file is an MCP stdio server that
lists more tools than a prompt can hold (`flood`) or one tool whose schema nests 80 levels (`deep`).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys

import httpx
import pytest

if __name__ != "__main__":  # the tests' imports; the server below needs only the MCP SDK
    from fastapi.testclient import TestClient

    from areal_core.agents.mcp import MAX_TOOLS, Connection, ServerFailure, ServerSpec
    from areal_core.models import build_tokenizer
    from areal_core.proxy.app import create_app
    from areal_core.proxy.examples import ScriptedEngine
    from areal_core.proxy.guard import ProxyLimits
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.remote_engine import segment_problem
    from areal_core.rollout.vllm_engine import VLLMEngine, VLLMEngineError
    from tests.test_remote_engine_requests import mock_http  # noqa: F401 - the fixture

KEY = "sk-edges"
USER = [{"role": "user", "content": "Ann has 3 pens"}]


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object", "properties": {}}}}


def test_a_chat_request_with_more_tools_than_the_limit_is_400_in_the_error_shape():
    tok = build_tokenizer(["Ann has 3 pens and gets 4 more."], 300)
    app = create_app(ScriptedEngine(tok, lambda _: "ok"), tok, api_keys=[KEY], limits=ProxyLimits(max_tools=3))
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        over = client.post("/v1/chat/completions", headers=auth, json={"model": "m", "messages": USER, "tools": [
            tool(i) for i in range(4)
        ]})  # fmt: skip
        assert over.status_code == 400
        assert over.json()["error"] == {
            "message": "4 tools exceed the limit of 3",
            "type": "invalid_request_error",
            "param": None,
            "code": "too_many_tools",
        }
        fits = client.post("/v1/chat/completions", headers=auth, json={"model": "m", "messages": USER, "tools": [
            tool(i) for i in range(3)
        ]})  # fmt: skip
        assert fits.status_code == 200 and fits.json()["choices"][0]["message"]["content"] == "ok"
    assert ProxyLimits().max_tools == 128 == MAX_TOOLS  # OpenAI's own limit; an MCP server's list as well


# -- a vLLM server's generate response ------------------------------------------------------------
def choice(token_ids, logprobs, finish="stop") -> dict:
    return {
        "token_ids": token_ids,
        "logprobs": {"content": [{"logprob": lp} for lp in logprobs]},
        "finish_reason": finish,
        "weight_versions": [{"version": 0, "start": 0, "end": len(token_ids)}],
    }


HOSTILE = {
    "more-tokens-than-asked": {"choices": [choice([7] * 5, [-0.5] * 5)]},
    "negative-token-id": {"choices": [choice([-3], [-0.5])]},
    "token-id-a-float": {"choices": [choice([7.0], [-0.5])]},
    "token-id-a-string": {"choices": [choice(["7"], [-0.5])]},
    "nan-logprob": {"choices": [choice([7], [math.nan])]},
    "logprob-a-word": {"choices": [choice([7], ["high"])]},
    "no-choices": {"choices": []},
    "not-an-object": [1, 2, 3],
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_a_malformed_vllm_response_is_a_named_engine_error_never_a_sample(mock_http, case):  # noqa: F811
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc":
            return httpx.Response(200, json={"results": ["cuda"]})
        body = json.dumps(HOSTILE[case])  # NaN written as the bare literal, as Python's json and vLLM's would
        return httpx.Response(200, content=body.encode(), headers={"content-type": "application/json"})

    mock_http(handler)
    engine = VLLMEngine("http://127.0.0.1:9", 0, eos_id=2, set_version=False, interrupt="abort")
    try:
        with pytest.raises(VLLMEngineError, match="malformed response"):
            engine.generate([[5, 6, 8]], SamplingParams(max_new_tokens=4))
    finally:
        engine.close()


def test_segment_problem_accepts_a_well_formed_segment_exactly_at_its_budget():
    assert segment_problem([7, 8], [-0.5, 0.0], [3, 3], budget=2) is None
    assert segment_problem([], [], [], budget=0) is None
    assert segment_problem([7, 8], [-0.5, -0.1], [3, 3], budget=1) == "2 tokens for a budget of 1"
    assert segment_problem([True], [-0.5], [3], budget=1) == "a token id that is not a non-negative integer"


# -- an MCP server's tool list ---------------------------------------------------------------------
def open_fails(mode: str) -> ServerFailure:
    spec = ServerSpec(mode, command=sys.executable, args=(__file__, mode), connect_timeout_s=120)

    async def go() -> ServerFailure:
        conn = Connection(spec)
        try:
            await conn.open()
        except ServerFailure as exc:
            return exc
        finally:
            await conn.close()
        raise AssertionError(f"the {mode} server's tool list was accepted")

    return asyncio.run(go())


def test_an_mcp_server_listing_more_tools_than_a_prompt_holds_fails_its_connect():
    failure = open_fails("flood")
    assert failure.kind == "connect_failed"
    assert f"the server lists {MAX_TOOLS + 1} tools, over the limit of {MAX_TOOLS}" in failure.detail


def test_an_mcp_tool_schema_nested_too_deeply_fails_its_connect():
    failure = open_fails("deep")
    assert failure.kind == "connect_failed" and "tool 'deep': its input schema is nested too deeply" in failure.detail


def serve(mode: str) -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(mode, log_level="WARNING")

    def echo(text: str) -> str:
        return text

    if mode == "flood":
        for i in range(129):
            server.add_tool(echo, name=f"echo{i}")
    else:
        server.add_tool(echo, name="deep")
        schema: dict = {"type": "string"}
        for _ in range(40):  # 80 levels: past the 64 a prompt's JSON may nest, within what the SDK sends
            schema = {"type": "object", "properties": {"x": schema}}
        server._tool_manager._tools["deep"].parameters = schema
    server.run()


if __name__ == "__main__":
    serve(sys.argv[1])
