"""MCP servers as agent environments: real servers as subprocesses (stdio) and over HTTP, the real
proxy over HTTP, a scripted policy. Tools are listed and reach the model's template, their results
reach the trajectory token for token; isolation per episode unless stateless; the call budget; a
hanging, crashing or protocol-breaking server costs one counted episode and the run goes on; the
model's wrong calls are named events."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from areal_core.agents.mcp import ServerSpec
from areal_core.agents.tools import MCPEnvironment
from areal_core.agents.workflow import MCPWorkflow
from areal_core.config import load_config
from areal_core.models import build_tokenizer
from areal_core.proxy.agent_workflow import AgentWorkflow, workflow_class
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.templating import ChatTemplate
from benchmarks.fault_kit import SEEN, scripted_agent, scripted_reply, sleeping_pids
from benchmarks.fault_kit import mcp_episodes as run
from benchmarks.fault_kit import mcp_task as task
from tests.conftest import ROOT

# ordinary calls: a limit no busy machine reaches (the timeout test sets its own, far below its hang)
TOY = ServerSpec("toy", command="python", args=("-m", "examples.toy_mcp.server"), call_timeout_s=120)
# no outcome of the misbehaving server's test is a timeout: a limit far above what its calls take on a
# loaded machine (its 3 MB answer once took over 5 s under CI load, and the episode was lost)
BAD = ServerSpec("bad", command="python", args=("tests/test_mcp_servers.py", "bad"), call_timeout_s=300, stateless=True)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call> #### 42'], 300)


def told(pid: str) -> list[str]:
    """The tool messages an episode's agent sent back to the model."""
    return [m["content"] for m in SEEN[pid]["result"].messages if isinstance(m, dict) and m["role"] == "tool"]


def test_stdio_tools_reach_the_template_results_the_trajectory_and_each_episode_its_own_server(tok):
    """Tools listed (in the template's `# Tools`), called, their results in the row token for token;
    the next episode's server is a fresh process: the note written in episode 1 is not there."""
    t = task("stdio", [("add", {"a": 2, "b": 40}), ("write_note", {"text": "hello"}), ("read_notes", {})], "hello")
    (r, r2), stats = run(tok, [TOY], [t, task("r", [("read_notes", {})], "(empty)")], tool_prompt="full")
    assert r.error is None and r.reward == 1.0 and len(r.samples) == 1
    seen = SEEN["stdio"]
    assert seen["tools"].names == ["add", "write_note", "read_notes", "wait"]
    row, messages = r.samples[0], seen["result"].messages
    text = tok.decode(row.input_ids)
    assert '"name": "write_note"' in text and "Write a note in the notebook" in text  # listed in `# Tools`
    assert told("stdio") == ["42", "1 notes", "hello"]
    # the row is exactly the conversation as the template renders it, the results fed verbatim
    ids, mask = ChatTemplate(tok, tool_prompt="full").episode(messages, seen["tools"].specs)
    assert (row.input_ids, row.loss_mask) == (ids, mask)
    assert told("r") == ["(empty)"] and r2.reward == 1.0
    assert stats["mcp"]["outcomes"] == {"ok": 2} and stats["mcp"]["tool_calls"] == 4


def test_a_stateless_server_is_shared_and_the_call_budget_and_wrong_calls(tok):
    """A stateless server is one session for every episode: episode 2 reads episode 1's note. Then
    unknown tools, wrong argument types and a loop past the budget are named events; the budget
    ends the episode, which is kept (the model earned it) and counted."""
    shared = ServerSpec("toy", command=TOY.command, args=TOY.args, stateless=True)
    calls = [("nope", {}), ("add", {"a": "two", "b": 1}), ("add", {"a": 1}), ("add", {"a": 1, "b": 1})]
    tasks = [task("w", [("write_note", {"text": "secret"})]), task("r", [("read_notes", {})], "(empty)")]
    tasks.append(task("loop", calls + [("add", {"a": 1, "b": 1})] * 6))
    (_, r2, r), stats = run(tok, [shared], tasks, max_calls=5)
    assert told("r") == ["secret"] and r2.reward == 0.0
    said = told("loop")
    assert said[0].startswith("error: unknown tool 'nope'; tools: add, write_note")
    assert said[1] == "error: argument 'a' must be of type integer, got str"
    assert said[2] == "error: missing argument(s) b" and said[3] == "2"
    assert said[5] == "error: the budget of 5 tool calls is used" and len(said) == 6
    assert SEEN["loop"]["result"].stopped == "budget" and r.error is None and r.samples and r.reward == 0.0
    mcp = stats["mcp"]
    assert mcp["outcomes"] == {"ok": 2, "budget_exceeded": 1}
    assert mcp["events"] == {"unknown_tool": 1, "bad_arguments": 2, "budget_exceeded": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server(tok):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "examples.toy_mcp.server", "--http", str(port)], cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        spec = ServerSpec.from_config({"url": url})
        assert spec.name == f"127.0.0.1:{port}"
        (r,), stats = run(tok, [spec], [task("http", [("add", {"a": 20, "b": 22})], "42")])
        assert r.error is None and r.reward == 1.0
        assert "<|im_start|>tool\n42<|im_end|>" in tok.decode(r.samples[0].input_ids)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_hanging_server_costs_one_counted_episode(tok):
    """A call that hangs past call_timeout_s drops its episode (no rows); the next episode, with a
    fresh server, succeeds; a server that never answers at start costs its episode too."""
    slow = ServerSpec("toy", command=TOY.command, args=TOY.args, call_timeout_s=1.0)
    t0 = time.time()
    (hung, fine), stats = run(
        tok, [slow], [task("hang", [("wait", {"seconds": 60})]), task("ok", [("add", {"a": 1, "b": 2})], "3")]
    )
    assert time.time() - t0 < 60  # the hang's own length: the timeout, not the hang, ended the call
    assert hung.samples == [] and "call_timeout" in hung.error and "'wait' did not answer within 1 s" in hung.error
    assert fine.error is None and fine.reward == 1.0
    assert stats["mcp"]["outcomes"] == {"call_timeout:toy": 1, "ok": 1} and stats["episodes_failed"] == 1
    silent = ServerSpec("silent", command="python", args=("tests/test_mcp_servers.py", "silent"), connect_timeout_s=2)
    (r,), stats = run(tok, [silent], [task("silent", [])])
    assert r.samples == [] and "connect_timeout" in r.error
    assert stats["mcp"]["outcomes"] == {"connect_timeout:silent": 1}


def test_a_misbehaving_server_costs_episodes_not_the_run(tok):
    """One shared server answering malformed JSON-RPC, non-UTF-8 bytes and 3 MB, then crashing:
    each episode gets a named outcome and the run goes on (the crashed server is reconnected)."""
    tasks = [
        task("latin1", [("latin1", {})]),
        task("huge", [("huge", {})]),
        task("malformed", [("malformed", {})]),
        task("echo1", [("echo", {"text": "hi"})], "hi"),
        task("crash", [("crash", {})]),
        task("echo2", [("echo", {"text": "again"})], "again"),
    ]
    results, stats = run(tok, [BAD], tasks, max_result_chars=1000)
    by = {t["prompt_id"]: r for t, r in zip(tasks, results)}
    (latin1,), (huge,) = told("latin1"), told("huge")
    assert latin1 == "caf\ufffd cr\ufffdme \ufffd\n[some bytes were not UTF-8 and were replaced]"
    assert huge == "x" * 1000 + "\n[cut: 1000 of 3000000 characters shown]"
    assert by["malformed"].samples == [] and "protocol_error" in by["malformed"].error
    assert by["crash"].samples == [] and "server_crashed" in by["crash"].error
    assert by["echo1"].reward == 1.0 and by["echo2"].reward == 1.0
    mcp = stats["mcp"]
    assert mcp["outcomes"] == {"ok": 4, "protocol_error:bad": 1, "server_crashed:bad": 1}
    assert mcp["events"] == {"result_not_utf8": 1, "result_cut": 1}


def test_the_config_selects_the_mcp_workflow():
    cfg = load_config(
        str(ROOT / "configs" / "agent_search.yaml"), ["agent.mcp_call_timeout_s=7", "agent.mcp_max_calls=3"]
    )
    cls, extra = workflow_class(cfg.agent)
    assert cls is MCPWorkflow and extra == {"mcp": cfg.agent}
    assert workflow_class(load_config(None).agent) == (AgentWorkflow, {})
    env = MCPEnvironment.from_config(cfg.agent)
    (spec,) = env.servers
    assert spec.name == "examples.search_agent.server" and spec.stateless and spec.call_timeout_s == 7.0
    assert env.max_calls == 3 and spec.executable() == sys.executable


def test_agent_configs_with_mcp_servers_key_their_warm_start():
    """prepare hashes the agent section into the SFT key: its MCP servers (models) must serialise,
    and a change of server changes the key."""
    from areal_core.run.pipeline import sft_key

    cfg = load_config(str(ROOT / "configs" / "agent_python.yaml"))
    (server,) = cfg.agent.mcp_servers
    assert server.transport == "http" and "{port}" in server.args
    key = json.loads(sft_key(cfg))
    assert key["agent"]["mcp_servers"][0]["transport"] == "http"
    other = load_config(str(ROOT / "configs" / "agent_python.yaml"), ["agent.mcp_max_calls=5"])
    assert sft_key(other) != sft_key(cfg)


def test_an_mcp_agent_run_without_servers_says_so(tok):
    workflow = AgentWorkflow(tok, scripted_agent_with_default_tools, group_size=1)
    try:
        result = asyncio.run(workflow.run_episode(ScriptedEngine(tok, scripted_reply), task("none", [])))
    finally:
        workflow.close()
    assert result.samples == [] and "this agent needs MCP tools: run it with agent.mcp_servers set" in result.error


async def scripted_agent_with_default_tools(task, base_url, api_key, tools=None):
    return await scripted_agent(task, base_url, api_key, tools)


def test_what_a_server_s_tools_start_dies_with_the_server(tok):
    """Issue 46: a stdio server's tools start processes as plain children, after setsid, and as
    orphans of a double fork; once the episodes end, none is left (the server ran under
    agents/mcp_reaper.py)."""
    spawner = ServerSpec("spawner", command="python", args=("tests/test_mcp_servers.py", "spawner"), call_timeout_s=300)
    seconds = 4000 + os.getpid() % 1000  # a length no other process here sleeps
    calls = [("spawn", {"how": how, "seconds": seconds}) for how in ("child", "setsid", "orphan")]
    (r,), _ = run(tok, [spawner], [task("spawn", calls)])
    assert r.error is None and len(told("spawn")) == 3 and all(p.isdigit() for p in told("spawn"))
    left = []
    for _ in range(100):  # the kernel kills the namespace as the server ends: gone at once, or soon after
        left = sleeping_pids(seconds)
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes the server's tools started outlived it: {left}"
