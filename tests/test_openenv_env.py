"""OpenEnv environments (`rollout.environment=openenv:<url>`): a real openenv-core 0.3.0 server
(an echo environment as `openenv init` lays one out, served by openenv's own `create_fastapi_app`
under uvicorn on 127.0.0.1) gives the prompts and grades the episodes that the model plays through
the proxy; servers that misbehave give one clear error, at prepare or as a counted failed episode."""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest
import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from areal_core.config import ConfigError
from areal_core.environments import ENVIRONMENT_AGENT
from areal_core.environments import load_records as load_environment_records
from areal_core.environments.openenv_env import Session, action_field, load_records, parse_spec, seeds
from areal_core.models import build_tokenizer
from areal_core.proxy.agent_workflow import AgentWorkflow
from areal_core.proxy.examples import ScriptedEngine
from areal_core.rollout.engine import SamplingParams
from task_data.registry import checked

# ---------------------------------------------------------------------------------------------
# The environment: openenv's echo template (reward 0.1 per character), seeded, two steps long
# ---------------------------------------------------------------------------------------------
LOG: list[dict[str, Any]] = []  # every step any session took: the environment's own account


class EchoAction(Action):
    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    echoed_message: str = Field(default="", description="The echoed message")
    message_length: int = Field(default=0, description="Length of the echoed message")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True
    MAX_STEPS = 2

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._seed: int | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> EchoObservation:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._seed = seed
        return EchoObservation(echoed_message=f"Echo environment ready! Episode {seed}.", done=False, reward=0.0)

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        if action.message == "crash":
            raise RuntimeError("the echo environment crashed")
        self._state.step_count += 1
        reward = len(action.message) * 0.1
        LOG.append(
            {
                "episode": self._state.episode_id,
                "seed": self._seed,
                "step": self._state.step_count,
                "message": action.message,
                "reward": reward,
                "completion_id": action.metadata.get("completion_id"),
            }
        )
        done = self._state.step_count >= self.MAX_STEPS
        return EchoObservation(
            echoed_message=action.message, message_length=len(action.message), done=done, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


def serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """`app` under uvicorn on 127.0.0.1 (a port bound here first), on a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=64 << 20, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(scope="module")
def echo_url():
    url, server, thread = serve(
        create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=256)
    )
    yield url
    server.should_exit = True
    thread.join(30)


# ---------------------------------------------------------------------------------------------
# A hostile server: /<when>-<what>/ws answers reset or step with something bad
# ---------------------------------------------------------------------------------------------
def _frame(obs: dict, reward: Any = 0.0, done: bool = False) -> str:
    return json.dumps({"type": "observation", "data": {"observation": obs, "reward": reward, "done": done}})


BAD = {
    "huge": lambda ws: ws.send_text(_frame({"echoed_message": "x" * (2 << 20)})),
    "notjson": lambda ws: ws.send_text("<html>502 Bad Gateway</html>"),
    "binary": lambda ws: ws.send_bytes(b"\x00\x01" * 10),
    "nan": lambda ws: ws.send_text(_frame({"echoed_message": "hi"}, reward=float("nan"))),
    "string": lambda ws: ws.send_text(_frame({"echoed_message": "hi"}, reward="1.0")),
    "shape": lambda ws: ws.send_text(json.dumps({"type": "observation", "data": ["not", "an", "object"]})),
    "dies": lambda ws: ws.close(code=1011),
    "hang": lambda ws: asyncio.sleep(0),  # no answer: it reads on (the client's close ends it)
}


async def hostile_ws(ws: WebSocket) -> None:
    when, what = ws.path_params["mode"].split("-")
    await ws.accept()
    while True:
        msg = json.loads(await ws.receive_text())
        if msg["type"] == "close":
            await ws.close()
            return
        if msg["type"] == when:
            await BAD[what](ws)
            if what == "dies":
                return
        else:
            await ws.send_text(_frame({"echoed_message": "ready"}))


async def hostile_schema(request: Any) -> JSONResponse:
    action = EchoAction.model_json_schema()
    if request.path_params["mode"] == "schema-huge":
        action["description"] = "x" * (2 << 20)
    return JSONResponse({"action": action, "observation": {}, "state": {}})


@pytest.fixture(scope="module")
def hostile_url():
    app = Starlette(routes=[WebSocketRoute("/{mode}/ws", hostile_ws), Route("/{mode}/schema", hostile_schema)])
    url, server, thread = serve(app)
    yield url
    server.should_exit = True
    thread.join(30)


# ---------------------------------------------------------------------------------------------
# Episodes through the proxy, the policy scripted
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer([f"Echo environment ready! Episode {i}. xxxx crash" for i in range(50)], 300)


def scripted_reply(prompt_text: str) -> str:
    """Turn n of an episode says 'x' * 2n (the environment pays 0.2 n), or what the last user asked for."""
    users = prompt_text.count("<|im_start|>user")
    if "say crash" in prompt_text:
        return "crash"
    return "x" * (2 * users)


@dataclass
class Run:
    results: list[Any] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def play(tok: Any, tasks: list[dict[str, Any]], reply: Any = scripted_reply, group_size: int = 2) -> Run:
    """group_size episodes of each task through AgentWorkflow (the run's environment agent) and a proxy."""
    workflow = AgentWorkflow(
        tok, ENVIRONMENT_AGENT, group_size=group_size, sampling=SamplingParams(max_new_tokens=16), episode_timeout_s=120
    )
    engine = ScriptedEngine(tok, reply)

    async def main() -> list[Any]:
        return [await workflow.run_episode(engine, t, k) for t in tasks for k in range(group_size)]

    try:
        results = asyncio.run(main())
    finally:
        workflow.close()
    return Run(results, workflow.stats())


def task_for(spec: str, seed: int = 7) -> dict[str, Any]:
    meta = {"environment": f"openenv:{spec}", "openenv": {"reset": {"seed": seed}, "action": "message"}}
    return {"prompt_id": f"t{seed}", "prompt": "p", "answer": "{}", "meta": meta}


def env_steps(completion_ids: list[str]) -> list[dict[str, Any]]:
    by_id = {e["completion_id"]: e for e in LOG}
    return [by_id[c] for c in completion_ids]


# ---------------------------------------------------------------------------------------------
# The spec, the records
# ---------------------------------------------------------------------------------------------
def test_the_spec_and_its_options():
    s = parse_spec("http://127.0.0.1:8000/")
    assert (s.url, s.ws_url, s.turns, s.timeout_s, s.max_bytes, s.action) == (
        "http://127.0.0.1:8000",
        "ws://127.0.0.1:8000/ws",
        4,
        60.0,
        1 << 20,
        "",
    )
    s = parse_spec("wss://envs.example/echo#turns=2&action=text&max_bytes=4096&observation=pkg.m:render")
    assert (s.url, s.ws_url, s.turns, s.max_bytes, s.action, s.observation, s.local) == (
        "https://envs.example/echo",
        "wss://envs.example/echo/ws",
        2,
        4096,
        "text",
        "pkg.m:render",
        False,
    )
    for bad, message in [
        ("127.0.0.1:8000", "openenv needs the server's URL"),
        ("ftp://h/x", "openenv needs the server's URL"),
        ("http://h#turn=2", "unknown openenv option 'turn'"),
        ("http://h#turns=two", "openenv option turns='two' is not a number"),
        ("http://h#turns=0", "turns >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            parse_spec(bad)
        assert str(err.value).startswith("config key 'rollout.environment'") and "\n" not in str(err.value)


def test_the_action_field_is_the_single_string_field():
    assert action_field(EchoAction.model_json_schema()) == "message"

    class TwoFields(Action):
        message: str
        language: str

    with pytest.raises(ValueError, match=r"fields are \['language', 'message'\].*'#action=<field>'"):
        action_field(TwoFields.model_json_schema())


def test_the_records_are_the_reset_observations_of_disjoint_seeds(echo_url):
    task = SimpleNamespace(name="arithmetic", num_train=30, num_eval=10)
    train, held_out = load_environment_records(f"openenv:{echo_url}", task, 3)
    train, held_out = checked(task, (train, held_out), "rollout.environment")  # the registry's own checks
    train_seeds, eval_seeds = seeds(3, 30, 10)
    assert [r["meta"]["openenv"]["reset"]["seed"] for r in train] == train_seeds
    assert [r["meta"]["openenv"]["reset"]["seed"] for r in held_out] == eval_seeds
    assert len(set(train_seeds) | set(eval_seeds)) == 40  # disjoint, distinct
    for r in train + held_out:
        seed = r["meta"]["openenv"]["reset"]["seed"]
        assert r["prompt"] == f"Echo environment ready! Episode {seed}."  # the reset observation's one string
        assert r["answer"] == json.dumps({"seed": seed}) and r["prompt_id"] == f"openenv-{seed}"
        assert r["meta"]["environment"] == f"openenv:{echo_url}" and r["meta"]["openenv"]["action"] == "message"
    assert seeds(3, 30, 10) == (train_seeds, eval_seeds) and seeds(4, 30, 10)[0] != train_seeds  # the run's seed


# ---------------------------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------------------------
def test_an_episode_is_paid_what_the_environment_computed(tok, echo_url):
    task = load_records(echo_url, SimpleNamespace(num_train=2, num_eval=1), 0)[0][0]
    task["meta"]["environment"] = f"openenv:{echo_url}"
    run = play(tok, [task], group_size=2)
    assert run.stats["episodes"] == 2 and run.stats["episodes_failed"] == 0
    for result in run.results:
        assert result.error is None and len(result.samples) == 1
        row = result.samples[0]
        completion_ids = [t[0] for t in row.meta["turns"]]
        steps = env_steps(completion_ids)
        # two turns (the environment is done after two steps), each the scripted reply, paid 0.1 per character
        assert [s["message"] for s in steps] == ["xx", "xxxx"] and [s["step"] for s in steps] == [1, 2]
        assert {s["seed"] for s in steps} == {task["meta"]["openenv"]["reset"]["seed"]}
        assert len({s["episode"] for s in steps}) == 1  # one session: one environment
        assert result.reward == sum(s["reward"] for s in steps) == pytest.approx(0.6)
        assert row.reward == pytest.approx(result.reward) and row.reward_info["reward_source"] == "agent"
        assert row.reward_info["openenv"] == {"step_rewards": [s["reward"] for s in steps], "end": "done"}
        assert row.num_turns == 2


def test_turns_caps_the_episode_and_hooks_map_text_and_observation(tok, echo_url):
    spec = f"{echo_url}#turns=1&action=tests.test_openenv_env:shout&observation=tests.test_openenv_env:ask"
    seen: list[str] = []

    def reply(prompt_text: str) -> str:
        seen.append(prompt_text)
        return "abc"

    run = play(tok, [task_for(spec, seed=11)], reply=reply, group_size=1)
    (result,) = run.results
    steps = env_steps([t[0] for t in result.samples[0].meta["turns"]])
    assert [s["message"] for s in steps] == ["ABC!"] and result.reward == pytest.approx(0.4)
    assert result.samples[0].reward_info["openenv"] == {"step_rewards": [steps[0]["reward"]], "end": "turns"}
    assert "Please answer: Echo environment ready! Episode 11." in seen[0]


def shout(text: str, observation: dict[str, Any]) -> dict[str, Any]:
    return {"message": text.upper() + "!"}


def ask(observation: dict[str, Any]) -> str:
    return "Please answer: " + observation["echoed_message"]


def test_an_environment_that_fails_mid_episode_costs_that_episode_alone(tok, echo_url):
    def reply(prompt_text: str) -> str:
        return "crash" if "Episode 5." in prompt_text else "xx"

    run = play(tok, [task_for(echo_url, 5), task_for(echo_url, 6)], reply=reply, group_size=1)
    crashed, fine = run.results
    assert crashed.samples == [] and "the server says 'the echo environment crashed'" in crashed.error
    assert "(code 'EXECUTION_ERROR')" in crashed.error
    assert fine.error is None and fine.reward == pytest.approx(0.4)  # 'xx' twice
    assert run.stats["episodes"] == 2 and run.stats["episodes_failed"] == 1


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("huge", "a message over max_bytes=1048576"),
        ("notjson", "a frame that is not JSON: '<html>502 Bad Gateway</html>'"),
        ("binary", "a binary frame of 20 bytes"),
        ("nan", "the reward must be a finite number or null, got nan"),
        ("string", "the reward must be a finite number or null, got '1.0'"),
        ("shape", "an observation frame needs data.observation"),
        ("dies", "the connection closed"),
    ],
)
def test_a_hostile_server_mid_episode_is_a_failed_episode_with_a_clear_error(tok, hostile_url, what, message):
    run = play(tok, [task_for(f"{hostile_url}/step-{what}")], group_size=1)
    (result,) = run.results
    assert result.samples == [] and result.error.startswith("OpenEnvError: ")
    assert message in result.error and "\n" not in result.error and len(result.error) < 400
    assert run.stats["episodes_failed"] == 1


def test_a_server_that_never_answers_or_is_full_is_a_failed_episode(tok, hostile_url):
    run = play(tok, [task_for(f"{hostile_url}/step-hang#timeout_s=0.2")], group_size=1)
    assert "(step): no answer within 0.2 s" in run.results[0].error

    url, server, thread = serve(create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=1))
    try:

        async def hold_one_session() -> None:
            async with Session(parse_spec(url)) as first:
                await first.reset(seed=1)
                run = await asyncio.to_thread(play, tok, [task_for(url)], scripted_reply, 1)
                assert "(code 'CAPACITY_REACHED')" in run.results[0].error and run.stats["episodes_failed"] == 1

        asyncio.run(hold_one_session())
    finally:
        server.should_exit = True
        thread.join(30)


# ---------------------------------------------------------------------------------------------
# At prepare: one line naming rollout.environment, nothing written
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_refuses(
    tmp_path: Any, spec: str, message: str, key: str = "rollout.environment", sft: str = "false"
) -> None:
    from areal_core.run import pipeline
    from tests.conftest import TINY

    store = tmp_path / "run"
    overrides = [*TINY, f"store={store}", f"rollout.environment=openenv:{spec}", "train.eval_every=0"]
    with pytest.raises(ConfigError) as err:
        pipeline.prepare("", [*overrides, f"sft.enabled={sft}"])
    text = str(err.value)
    assert text.startswith(f"config key '{key}'") and message in text, text
    assert "\n" not in text and len(text) < 500
    assert not store.exists()


def test_a_warm_start_on_reset_seeds_is_refused_at_prepare(tmp_path, echo_url):
    _prepare_refuses(tmp_path, echo_url, "must be false with an openenv: environment", key="sft.enabled", sft="true")


def test_an_unreachable_server_is_refused_at_prepare(tmp_path):
    port = _free_port()
    _prepare_refuses(
        tmp_path, f"http://127.0.0.1:{port}", f"cannot reach the OpenEnv server at ws://127.0.0.1:{port}/ws"
    )


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("reset-huge", "(reset): a message over max_bytes=1048576"),
        ("reset-notjson", "(reset): a frame that is not JSON"),
        ("reset-nan", "(reset): the reward must be a finite number or null, got nan"),
        ("reset-dies", "(reset): the connection closed"),
        ("schema-huge", "/schema-huge/schema is over max_bytes=1048576"),
    ],
)
def test_a_hostile_server_is_refused_at_prepare(tmp_path, hostile_url, mode, message):
    _prepare_refuses(tmp_path, f"{hostile_url}/{mode}", message)


def test_an_action_with_no_single_string_field_is_refused_at_prepare(tmp_path):
    class TwoFields(Action):
        message: str
        language: str

    url, server, thread = serve(create_fastapi_app(EchoEnvironment, TwoFields, EchoObservation, max_concurrent_envs=4))
    try:
        _prepare_refuses(tmp_path, url, "the action's fields are ['language', 'message']")
        task = SimpleNamespace(num_train=2, num_eval=1)
        assert load_records(f"{url}#action=message", task, 0)[0][0]["meta"]["openenv"]["action"] == "message"
    finally:
        server.should_exit = True
        thread.join(30)


# ---------------------------------------------------------------------------------------------
# End to end: `pyflyte run` on a tiny checkpoint
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pyflyte_run_trains_on_an_openenv_environment_to_done(echo_url, tmp_path):
    """prepare (the records are the server's resets) -> RL with the environment's episodes -> evaluate;
    every stored row's reward is the sum of what the environment paid for that row's completions."""
    from areal_core.protocol import decode_shard
    from areal_core.store import Store
    from benchmarks import tiny_checkpoints as tc
    from tests.conftest import TINY
    from tests.test_flyte import pyflyte

    ckpt = tc.save("llama", tmp_path / "llama")
    root = tmp_path / "run"
    overrides = [*TINY, f"store={root}", f"model.path={ckpt}", "sft.enabled=false", "train.eval_every=0"]
    overrides += [f"rollout.environment=openenv:{echo_url}#turns=2", "task.num_train=16", "task.num_eval=4"]
    overrides += ["agent.reward_max=1000", "eval.num_samples=4"]  # 0.1 per character of two 8-token replies
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", shlex.join(overrides), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    store = Store(str(root))
    assert store.read_json("DONE")["step"] == 4
    rows = [s for p in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(p))]
    assert len({s.group_id for s in rows}) >= 4 * 2  # train.steps x train.batch_groups
    for s in rows:
        steps = env_steps([t[0] for t in s.meta["turns"]])
        assert 1 <= len(steps) == s.num_turns <= 2 and len({e["episode"] for e in steps}) == 1
        assert s.reward_info["reward_source"] == "agent"
        assert s.reward == pytest.approx(sum(e["reward"] for e in steps), rel=1e-6, abs=1e-6)
        assert s.reward_info["openenv"]["step_rewards"] == [e["reward"] for e in steps]
    assert any(s.reward > 0 for s in rows)  # the model said something, and was paid for it
