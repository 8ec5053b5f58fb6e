"""The Python-interpreter agent's MCP server: code runs in the bubblewrap sandbox, stateful within
an episode and not across, limits per call, output cut and said; the ideal episode earns 1.0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from areal_core.agents.mcp import ServerSpec
from areal_core.agents.tools import MCPEnvironment
from areal_core.agents.workflow import MCPWorkflow
from areal_core.models import build_tokenizer
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.templating import ChatTemplate
from examples.python_agent.agent import generate, python_agent, python_corpus, python_transcript
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap not installed (.ci/run installs it)"),
]
PYTHON = ServerSpec(
    "python",
    command="python",
    args=("-m", "examples.python_agent.server", "--wall-s", "20", "--cpu-s", "1", "--max-output", "100"),
)


def test_state_within_an_episode_none_across_limits_and_cut_output():
    env = MCPEnvironment([PYTHON], max_calls=10)

    async def main():
        async with env.episode() as tools:
            first = [await tools.call("run_python", {"code": c}) for c in ("x = 21", "print(x * 2)", "x * 1000")]
            limits = [await tools.call("run_python", {"code": c}) for c in ("while True: pass", "print('y' * 500)")]
            after = await tools.call("run_python", {"code": "1/0"})
        async with env.episode() as tools:
            second = await tools.call("run_python", {"code": "print(x)"})
        return first, limits, after, second

    first, limits, after, second = asyncio.run(main())
    assert first == ["(no output)", "42", "21000"]
    assert limits[0] == "error: cpu time limit (1s) (SIGXCPU)"
    assert limits[1] == "y" * 100 + "\n[output cut: 100 of 500 characters shown]"
    assert after == "error: ZeroDivisionError: division by zero"
    assert second == "error: NameError: name 'x' is not defined"  # a fresh interpreter
    assert env.outcomes == {"ok": 2}


def test_the_ideal_python_episode_earns_the_verifiers_reward():
    torch.set_num_threads(1)
    train, _ = generate(1, 2, 1)
    tok = build_tokenizer(python_corpus(train), 300)
    replies = {t["prompt"]: [m for m in python_transcript(t) if m["role"] == "assistant"] for t in train}

    def reply(prompt_text: str) -> str:
        question = prompt_text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        call, answer = replies[question]
        if "<|im_start|>tool\n" in prompt_text:
            return answer["content"]
        args = call["tool_calls"][0]["function"]["arguments"]
        return f'<tool_call>{{"name": "run_python", "arguments": {args}}}</tool_call>'

    env = MCPEnvironment([PYTHON], max_calls=4)
    workflow = MCPWorkflow(tok, python_agent, mcp=env, group_size=1)
    try:
        result = asyncio.run(workflow.run_episode(ScriptedEngine(tok, reply), train[0]))
    finally:
        workflow.close()
    assert result.error is None and result.reward == 1.0
    (row,) = result.samples
    assert (row.input_ids, row.loss_mask) == ChatTemplate(tok, tool_prompt="none").episode(python_transcript(train[0]))


def test_every_ideal_turn_fits_the_configs_per_turn_budget():
    """At 40 tokens a turn a six-number sum's tool call was cut (61 tokens at vocab 300), so no sum
    could ever score and RL had nothing to learn on half the tasks: every assistant turn of every
    ideal episode, in the tokenizer the config builds, must fit `rollout.max_new_tokens`."""
    from areal_core.config import load_config

    cfg = load_config(str(ROOT / "configs" / "agent_python.yaml"))
    train, held_out = generate(1, cfg.task.num_train, cfg.task.num_eval)
    tok = build_tokenizer(python_corpus(train), cfg.model.vocab_size)
    t = ChatTemplate(tok, tool_prompt="none")
    longest = {}
    for task in train + held_out:
        messages = python_transcript(task)
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                n = len(t.assistant_ids(messages[:k], m))
                kind = "sum" if "sum" in task["prompt"] else "product"
                longest[kind] = max(longest.get(kind, 0), n)
    assert set(longest) == {"sum", "product"}
    assert max(longest.values()) <= cfg.rollout.max_new_tokens, longest
    assert max(longest.values()) <= cfg.eval.max_new_tokens, longest


PYTHON_HTTP = ServerSpec(
    "python",
    command="python",
    args=("-m", "examples.python_agent.server", "--wall-s", "20", "--cpu-s", "1", "--http", "{port}"),
    transport="http",
)


def test_one_http_server_process_gives_each_episode_its_own_interpreter_and_is_restarted_when_it_dies():
    env = MCPEnvironment([PYTHON_HTTP], max_calls=10)
    served = env.served["python"]

    async def episode(value: int) -> list[str]:
        async with env.episode() as tools:
            out = [await tools.call("run_python", {"code": f"x = {value}"})]
            await asyncio.sleep(0.2)  # the other episode sets its own x meanwhile
            return out + [await tools.call("run_python", {"code": "print(x)"})]

    async def fresh() -> str:
        async with env.episode() as tools:
            return await tools.call("run_python", {"code": "print(x)"})

    async def main():
        both = await asyncio.gather(episode(1), episode(2))
        pid = served.proc.pid
        after = await fresh()
        served.proc.kill()  # the server dies between episodes: the next episode starts it again
        served.proc.wait(5)
        again = await fresh()
        return both, pid, after, again

    try:
        both, pid, after, again = asyncio.run(main())
        assert both == [["(no output)", "1"], ["(no output)", "2"]]  # concurrent sessions, separate state
        assert after == again == "error: NameError: name 'x' is not defined"
        assert served.starts == 2 and served.proc.pid != pid
        assert env.outcomes == {"ok": 4} and env.stats()["server_starts"] == {"python": 2}
        proc = served.proc
    finally:
        env.close()
    assert proc.poll() is not None and served.proc is None  # close() ends the process


def test_an_http_command_that_never_listens_or_exits_costs_a_counted_episode_and_the_next_fails_fast():
    never = ServerSpec(
        "never",
        command="python",
        args=("-c", "import sys, time; sys.argv.append('{port}'); time.sleep(60)"),
        transport="http",
        connect_timeout_s=1.5,
    )
    dies = ServerSpec("dies", command="python", args=("-c", "raise SystemExit('bad flag {port}')"), transport="http")

    async def one(env: MCPEnvironment) -> str:
        try:
            async with env.episode():
                return "connected"
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    async def twice(spec: ServerSpec) -> tuple[list[str], dict, int, float]:
        env = MCPEnvironment([spec])
        try:
            first = await one(env)
            t0 = time.monotonic()
            second = await one(env)  # within RETRY_AFTER_S: the same failure at once, no new process
            return [first, second], dict(env.outcomes), env.served[spec.name].starts, time.monotonic() - t0
        finally:
            env.close()

    (timed_out, again), outcomes, starts, waited = asyncio.run(twice(never))
    assert timed_out.startswith("ServerFailure: MCP server 'never': connect_timeout: not listening on port")
    assert again == timed_out and starts == 1  # the same failure again, no new process (within RETRY_AFTER_S)
    assert outcomes == {"connect_timeout:never": 2}
    (failed, _), outcomes, _, _ = asyncio.run(twice(dies))
    assert "connect_failed: exited with status 1 (stderr: bad flag " in failed
    assert outcomes == {"connect_failed:dies": 2}


def test_a_listener_of_another_process_on_the_port_is_not_taken_for_the_server(monkeypatch):
    """The port picked is taken by a stranger before the server binds it: the server is started
    again on another port, and episodes reach it, not the stranger."""
    from areal_core.agents import served

    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    ports = iter([stranger.getsockname()[1]])
    real = served.free_port
    monkeypatch.setattr(served, "free_port", lambda: next(ports, None) or real())
    env = MCPEnvironment([PYTHON_HTTP])

    async def main() -> str:
        async with env.episode() as tools:
            return await tools.call("run_python", {"code": "6 * 7"})

    try:
        assert asyncio.run(main()) == "42"
        assert env.served["python"].starts == 2 and env.served["python"].port != stranger.getsockname()[1]
    finally:
        env.close()
        stranger.close()


def test_a_wrapper_command_whose_child_listens_is_the_server():
    """`sh -c '...; true'` (or `uv run ...`): the listener is the wrapper's child, not the process started."""
    toy = ServerSpec(
        "toy",
        command="sh",
        args=("-c", f"{sys.executable} -m examples.toy_mcp.server --http {{port}}; true"),
        transport="http",
        connect_timeout_s=30,
    )
    env = MCPEnvironment([toy])

    async def main():
        async with env.episode() as tools:
            return await tools.call("add", {"a": 20, "b": 22})

    try:
        assert asyncio.run(main()) == "42" and env.served["toy"].starts == 1
    finally:
        env.close()
    assert env.served["toy"].proc is None


def test_the_http_server_dies_with_the_worker_that_started_it(tmp_path):
    """SIGKILL of the worker: the kernel ends the server it started (no orphan left listening)."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys, time
            sys.path.insert(0, {str(ROOT)!r})
            from areal_core.agents.mcp import ServerSpec
            from areal_core.agents.tools import MCPEnvironment
            spec = ServerSpec("python", command="python", transport="http",
                              args=("-m", "examples.python_agent.server", "--http", "{{port}}"))
            env = MCPEnvironment([spec])
            async def main():
                async with env.episode() as tools:
                    await tools.call("run_python", {{"code": "1"}})
                print(env.served["python"].proc.pid, flush=True)
                time.sleep(60)
            asyncio.run(main())
            """
        )
    )
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(worker.stdout.readline())
        assert os.path.exists(f"/proc/{server_pid}")
        worker.kill()
        worker.wait(120)
        deadline = time.monotonic() + 120
        while os.path.exists(f"/proc/{server_pid}") and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server_pid, os.WNOHANG)
            time.sleep(0.1)
        alive = os.path.exists(f"/proc/{server_pid}") and "Z" not in open(f"/proc/{server_pid}/stat").read().split()[2]
        assert not alive
    finally:
        worker.kill()


def test_an_http_call_outside_a_session_is_refused():
    """The Python server over HTTP keeps state per MCP session; a client without one (the stateless
    2026 protocol) is told so rather than sharing an interpreter with every other such client."""
    env = MCPEnvironment([PYTHON_HTTP])

    async def main() -> str:
        from mcp import Client

        spec = await env.served["python"].url_spec()
        async with Client(spec.url) as client:  # mode auto: no session
            result = await client.call_tool("run_python", {"code": "1"})
            return result.content[0].text

    try:
        assert "keeps state per MCP session" in asyncio.run(main())
    finally:
        env.close()


@pytest.mark.parametrize(
    "server, problem",
    [
        ({"command": "python", "args": ["-m", "x"], "transport": "http"}, "must hold {port}"),
        ({"url": "http://127.0.0.1:1/mcp", "transport": "http"}, "http is for a command"),
        ({"command": "python", "args": ["{port}"], "transport": "http", "http_path": "mcp"}, "must start with '/'"),
        ({"command": "python", "transport": "sse"}, "transport"),
    ],
)
def test_http_transport_config_errors(server, problem):
    from areal_core.config.agent import MCPServerConfig

    with pytest.raises(ValueError, match=re.escape(problem)):
        MCPServerConfig.model_validate(server)
