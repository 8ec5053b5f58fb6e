"""Agent workflows: user agents (`async def run(task, base_url, api_key) -> float`) run against an
in-process proxy inside the one rollout worker; groups start under the admission rule; episodes
land in the store as ungraded shards whose rows are exactly what the proxy served, and the
reward workers keep a reward the agent returned (`reward_source`) and grade the rest."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time

import httpx
import openai
import pytest
import torch

from areal_core.layout import LAYOUT
from areal_core.models import build_tokenizer
from areal_core.protocol import Sample, decode_shard
from areal_core.proxy.agent_workflow import AgentWorkflow, evaluate_agent
from areal_core.proxy.examples import (
    ScriptedEngine,
    calculator_agent,
    calculator_corpus,
    calculator_transcript,
    langchain_calculator_agent,
    scripted_calculator_reply,
)
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.templating import ChatTemplate
from areal_core.reward.pool import RewardPool
from areal_core.reward.worker import grade_shard
from areal_core.rollout.admission import Admission, recover_progress
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.worker import RolloutLoop
from areal_core.store import Store
from task_data.arithmetic import generate


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data():
    train, held_out = generate(1, 40, 10, ops="+-*", lo=2, hi=9, max_steps=3)
    tok = build_tokenizer(calculator_corpus(train), 300)
    return tok, train, held_out


def shard_rows(store: Store, stage: str) -> dict[str, list[Sample]]:
    return {p: decode_shard(store.read_bytes(p)) for p in store.find(f"trajectories/{stage}", ".arrow")}


def policy_runs(s: Sample) -> list[list[int]]:
    """The contiguous runs of loss-masked (model-produced) tokens."""
    runs, cur = [], []
    for t, m in zip(s.input_ids, s.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def assert_perfect_calculator_row(tok, s: Sample, task: dict) -> None:
    """The row of a perfect episode: what the scripted policy served, one run per turn, nothing else."""
    steps = task["meta"]["steps"]
    assert s.num_turns == steps + 1 and s.meta["tool_calls"] == steps and s.meta["segments"] == 1
    transcript = calculator_transcript(task)
    t = ChatTemplate(tok, tool_prompt="none")
    expected_replies = [
        t.assistant_ids(transcript[:k], m) for k, m in enumerate(transcript) if m["role"] == "assistant"
    ]
    assert policy_runs(s) == expected_replies
    assert (s.input_ids, s.loss_mask) == t.episode(transcript)
    whole = tok.apply_chat_template(transcript, tokenize=True, return_dict=False)
    assert s.input_ids + t.close_ids(s.input_ids) == whole  # the model's own template, whole
    assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)
    assert all(lp == 0.0 for lp, m in zip(s.behav_logprobs, s.loss_mask) if not m)
    assert s.prompt_len == s.loss_mask.index(1)


def constant_reward(completion: str, reference: str, **_: object) -> float:
    """The reward workers' verdict in these tests: tells a regraded row from a kept one."""
    return 0.25


def agent_loop(store: Store, engine, agent, tasks, *, worker_id="rollout-0", admission=None, **kw):
    """The rollout worker's loop over an `AgentWorkflow`, without a prepared run."""
    workflow = AgentWorkflow(engine.tokenizer, agent, worker_id=worker_id, **{"group_size": 2, **kw})
    progress = recover_progress(store, worker_id)
    adm = admission or Admission(num_prompts=len(tasks), seed=0, batch_groups=1, eta=0, enabled=False)
    loop = RolloutLoop(workflow, AsyncEngine(engine), tasks, adm, store, worker_id, next_seq=progress.next_seq)
    return workflow, loop


def run_groups(store: Store, engine, agent, tasks, num_groups: int, **kw) -> dict:
    workflow, loop = agent_loop(store, engine, agent, tasks, **kw)
    try:
        result = asyncio.run(loop.run(num_groups=num_groups))
    finally:
        workflow.close()
        loop.engine.close()
    return {**result, **workflow.stats()}


def rows_of(store: Store, stage: str, worker: str = "") -> list[Sample]:
    return [s for p, rows in shard_rows(store, stage).items() if f"/{worker}" in p for s in rows]


def grade_all(store: Store, tok, tasks) -> list[Sample]:
    """Every ungraded shard through the reward worker's grading, as a reward worker does."""
    refs = {t["prompt_id"]: t for t in tasks}
    with RewardPool("tests.test_proxy_agent:constant_reward", 1, 10.0, 0) as pool:
        for rel in store.find("trajectories/ungraded", ".arrow"):
            grade_shard(store, rel, pool, refs, tok)
    return rows_of(store, "graded")


def test_calculator_agent_groups_are_ungraded_shards_that_keep_the_agents_reward(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=0)
    adm = Admission(num_prompts=len(train), seed=0, batch_groups=3, eta=0)
    stats = run_groups(store, engine, calculator_agent, train, 3, admission=adm)
    assert stats["groups"] == 3 and stats["episodes"] == 6 and stats["episodes_failed"] == 0
    assert stats["mean_reward"] == 1.0
    assert store.find("trajectories/ungraded") and not store.find("trajectories/graded")
    by_prompt = {t["prompt_id"]: t for t in train}
    groups: dict[str, list[Sample]] = {}
    for s in rows_of(store, "ungraded"):
        groups.setdefault(s.group_id, []).append(s)
        assert s.reward == 1.0 and s.reward_info["reward_source"] == "agent"
        assert s.worker_id == "rollout-0" and s.min_version() == 0
        assert_perfect_calculator_row(tok, s, by_prompt[s.prompt_id])
    assert sorted(groups) == [f"rollout-0-g{g:07d}" for g in range(3)]
    assert all(len(rows) == 2 for rows in groups.values())
    assert sum(1 for rows in groups.values() for s in rows if s.num_turns > 2) > 0  # multi-step tool use
    # the reward worker keeps the agent's reward and says so
    graded = grade_all(store, tok, train)
    assert len(graded) == 6 and all(s.reward == 1.0 and s.reward_info["reward_source"] == "agent" for s in graded)


def test_admission_holds_new_groups_until_a_newer_policy(data, tmp_path):
    """B=2, η=0: at version 0 only 2 groups may start; the rest wait for version 1."""
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=0)
    adm = Admission(num_prompts=len(train), seed=0, batch_groups=2, eta=0)
    workflow, loop = agent_loop(store, engine, calculator_agent, train, admission=adm)

    async def bump_when_blocked():
        while len(rows_of(store, "ungraded")) < 4:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert adm.started == 2 and adm.room(0) == 0  # held at (v + η + 1)·B = 2
        engine.version = 1

    async def main():
        bump = asyncio.create_task(bump_when_blocked())
        result = await loop.run(num_groups=4)
        await bump
        return result

    try:
        result = asyncio.run(main())
    finally:
        workflow.close()
        loop.engine.close()
    assert result["groups"] == 4
    by_group: dict[str, set[int]] = {}
    for s in rows_of(store, "ungraded"):
        by_group.setdefault(s.group_id, set()).add(s.min_version())
    assert by_group["rollout-0-g0000000"] == by_group["rollout-0-g0000001"] == {0}
    assert by_group["rollout-0-g0000002"] == by_group["rollout-0-g0000003"] == {1}


async def agent_returns_none(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await client.close()
    return None


async def agent_fails_midway(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await client.close()
    raise RuntimeError("tool crashed")


async def agent_never_calls(task, base_url, api_key):
    return 1.0


async def agent_rewards_per_turn(task, base_url, api_key):
    """Two turns; rewards each through the session endpoint; returns the final reward."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    msgs = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=msgs)
    sid = r.areal["session_id"]
    msgs += [r.choices[0].message, {"role": "user", "content": "sure?"}]
    await client.chat.completions.create(model="m", messages=msgs)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as h:
        assert (await h.post(f"/sessions/{sid}/reward", json={"reward": 0.5, "turn": 0})).status_code == 200
    await client.close()
    return 1.0


async def agent_with_two_conversations(task, base_url, api_key):
    """A planner and a solver conversation in one episode, told apart by X-Session-Id."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for role in ("planner", "solver"):
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"{role}: {task['prompt']}"}],
            extra_headers={"X-Session-Id": f"{role}-{api_key[-8:]}"},
        )
    await client.close()
    return 0.5


def test_every_session_of_an_episode_becomes_a_row(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)
    stats = run_groups(store, engine, agent_with_two_conversations, train, 1)
    assert stats["rows"] == 4 and stats["episodes_empty"] == 0
    rows = rows_of(store, "ungraded")
    assert sorted(tok.decode(s.input_ids).split("\n")[1].split(":")[0] for s in rows) == [
        "planner",
        "planner",
        "solver",
        "solver",
    ]
    assert all(s.reward == 0.5 and s.group_id == "rollout-0-g0000000" for s in rows)
    assert len({s.sample_id for s in rows}) == 4


async def agent_restarting_its_conversation(task, base_url, api_key):
    """Five requests on the key session, each a new conversation: five segments."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(5):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await client.close()
    return 0.75


def test_an_episode_keeps_the_rows_of_its_capped_sessions(data):
    """The key session reaches its segment cap twice: the episode's rows are still all five, with its
    reward; the capped ones say so in meta."""
    tok, train, _ = data
    engine = ScriptedEngine(tok, scripted_calculator_reply)
    workflow = AgentWorkflow(
        tok, agent_restarting_its_conversation, group_size=1, limits=ProxyLimits(max_key_session_segments=2)
    )
    try:
        result = asyncio.run(workflow.run_episode(engine, train[0]))
        counters = workflow.sessions.counters
    finally:
        workflow.close()
    assert result.error is None and len(result.samples) == 5 and {s.reward for s in result.samples} == {0.75}
    assert [s.meta.get("capped") for s in result.samples] == ["segments"] * 4 + [None]
    assert len({s.sample_id for s in result.samples}) == 5
    assert counters["capped"] == 2 and not workflow.capped


def test_unrewarded_failed_and_empty_episodes(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)

    def run(agent, worker_id, **kw):
        return run_groups(store, engine, agent, train, 1, worker_id=worker_id, **kw)

    s = run(agent_returns_none, "agent-none")
    assert s["rows"] == 2 and len(rows_of(store, "ungraded", "agent-none")) == 2
    assert all(row.reward is None for row in rows_of(store, "ungraded", "agent-none"))
    s = run(agent_fails_midway, "agent-fail")
    assert s["episodes_failed"] == 2 and s["rows"] == 0
    assert not [p for p in store.find("trajectories") if "agent-fail" in p]
    s = run(agent_never_calls, "agent-empty")
    assert s["episodes_empty"] == 2 and s["rows"] == 0
    s = run(agent_rewards_per_turn, "agent-turns", turn_discount=0.5)
    rows = rows_of(store, "ungraded", "agent-turns")
    assert len(rows) == 2
    for row in rows:  # r0 = 0.5, final 1.0 on turn 1: G0 = 0.5 + 0.5 * 1.0
        assert row.reward == 1.0 and row.reward_info["turn_returns"] == [1.0, 1.0] and row.num_turns == 2
    # the reward workers grade the unrewarded rows and keep the agents' rewards
    graded = {s.sample_id: s for s in grade_all(store, tok, train)}
    sources = {(s.worker_id, s.reward, s.reward_info["reward_source"]) for s in graded.values()}
    assert sources == {("agent-none", 0.25, "reward_worker"), ("agent-turns", 1.0, "agent")}


def test_restarted_worker_continues_after_its_shards(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)

    def admission() -> Admission:
        progress = recover_progress(store, "rollout-0")
        return Admission(num_prompts=len(train), seed=0, batch_groups=2, eta=0, progress=progress)

    run_groups(store, engine, calculator_agent, train, 2, admission=admission())
    adm = admission()
    assert adm.started == 2 and adm.room(0) == 0  # both groups of version 0 are already out
    engine.version = 1
    run_groups(store, engine, calculator_agent, train, 2, admission=adm)
    groups = sorted({s.group_id for s in rows_of(store, "ungraded")})
    assert groups == [f"rollout-0-g{g:07d}" for g in range(4)]
    seqs = [int(p.rsplit("/", 1)[1].split(".")[0]) for p in store.find("trajectories/ungraded/rollout-0")]
    assert seqs == list(range(len(seqs)))


def test_evaluate_agent_measures_held_out_success(data):
    tok, _, held_out = data
    good = ScriptedEngine(tok, scripted_calculator_reply)
    wrong = ScriptedEngine(tok, lambda _: "#### -1")  # answers are never negative
    assert asyncio.run(evaluate_agent(good, tok, "areal_core.proxy.examples:calculator_agent", held_out)) == 1.0
    assert asyncio.run(evaluate_agent(wrong, tok, calculator_agent, held_out)) == 0.0


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain-openai not installed")
def test_langchain_chat_openai_agent_through_the_proxy(data, tmp_path):
    """LangChain's ChatOpenAI, only base_url and api_key changed: tool calls round-trip and the
    history LangChain re-serialises still continues the same trajectory."""
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)
    tasks = [t for t in train if t["meta"]["steps"] >= 2][:2]
    stats = run_groups(store, engine, langchain_calculator_agent, tasks, 2, group_size=1)
    assert stats["episodes_failed"] == 0 and stats["mean_reward"] == 1.0
    rows = rows_of(store, "ungraded")
    assert len(rows) == 2
    by_prompt = {t["prompt_id"]: t for t in tasks}
    for s in rows:
        assert_perfect_calculator_row(tok, s, by_prompt[s.prompt_id])


def publish_init_model(store: Store, version: int) -> None:
    from areal_core.models import load_pretrained
    from areal_core.weights.publisher import hf_side_files, publish, state_dict_bytes

    model, tok = load_pretrained(store.url(LAYOUT.init_model))
    publish(store, version, state_dict_bytes(model), hf_side_files(model, tok))


def follow_weights_until_done(store: Store, run_uri: str, timeout_s: float = 600.0) -> dict:
    """The rollout role on a prepared agent run: (0 + η + 1)·B = 2 groups under v0, then 2 more
    under v1, then DONE."""
    from areal_core.rollout.worker import run_rollout_worker

    publish_init_model(store, 0)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run_rollout_worker(run_uri, 0)))
    worker.start()

    def groups() -> set[str]:
        return {s.group_id for s in rows_of(store, "ungraded")}

    deadline = time.time() + timeout_s
    while len(groups()) < 2 and time.time() < deadline and worker.is_alive():
        time.sleep(0.1)
    time.sleep(0.5)
    assert len(groups()) == 2  # (0 + η + 1)·B with B=2, η=0
    publish_init_model(store, 1)
    while len(groups()) < 4 and time.time() < deadline and worker.is_alive():
        time.sleep(0.1)
    store.write_text("DONE", "")
    worker.join(timeout=timeout_s)
    assert not worker.is_alive()
    assert result["groups"] == 4 and len(groups()) == 4
    rows = rows_of(store, "ungraded")
    assert len(rows) == 8 and all(s.reward in (0.0, 1.0) and s.reward_info["reward_source"] == "agent" for s in rows)
    assert sorted({s.min_version() for s in rows}) == [0, 1]
    assert store.statuses()["rollout-0"]["groups_started"] == 4
    return result


AGENT = ["rollout.agent=areal_core.proxy.examples:calculator_agent", "agent.episode_timeout_s=60"]


def test_agent_rollout_worker_follows_weights_and_stops_at_done(tiny_overrides):
    """The one rollout worker runs the agent workflow when rollout.agent is set."""
    from areal_core.run import pipeline

    run_uri, _ = pipeline.prepare("", [*tiny_overrides, *AGENT, "train.eta=0", "rollout.group_size=2"])
    pipeline.sft(run_uri)
    follow_weights_until_done(Store(run_uri), run_uri)


@pytest.mark.vllm
@pytest.mark.slow
def test_agent_rollout_worker_on_a_vllm_engine(tiny_overrides, tmp_path):
    """rollout.engine=vllm with rollout.agent: the agent's proxy serves from a vLLM server."""
    from areal_core.config.run import DEFAULT_VLLM_PYTHON, resolve_python
    from areal_core.run import pipeline

    if not resolve_python(DEFAULT_VLLM_PYTHON).exists():
        pytest.skip("vLLM venv absent (.venv-vllm/bin/python): run `make vllm-venv` to run this test")
    vllm = ["rollout.engine=vllm", "rollout.server.kv_cache_mb=64", "rollout.server.max_num_seqs=16"]
    vllm += ["model.hidden_size=64", "model.num_heads=2"]  # vLLM's CPU attention needs head_dim >= 32
    run_uri, _ = pipeline.prepare("", [*tiny_overrides, *AGENT, *vllm, "train.eta=0", "rollout.group_size=2"])
    pipeline.sft(run_uri)
    follow_weights_until_done(Store(run_uri), run_uri, timeout_s=600)
