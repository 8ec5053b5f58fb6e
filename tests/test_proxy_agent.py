"""Agent workflows: user agents (`async def run(task, base_url, api_key) -> float`) run against an
in-process proxy; groups start under the admission rule; episodes land in the store as shards
whose rows are exactly what the proxy served."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time

import httpx
import openai
import pytest
import torch

from areal_core.models import build_tokenizer
from areal_core.protocol import Sample, decode_shard
from areal_core.proxy.agent import AgentRunner, evaluate_agent, run_agent_rollout_worker
from areal_core.proxy.examples import (
    ScriptedEngine,
    calculator_agent,
    calculator_corpus,
    calculator_transcript,
    langchain_calculator_agent,
    scripted_calculator_reply,
)
from areal_core.proxy.templating import ChatMLTemplate
from areal_core.store import Store
from datasets.arithmetic import generate


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
    t = ChatMLTemplate(tok, tool_prompt="none")
    expected_replies = [
        t.render_message(m)[len("<|im_start|>assistant\n") :] for m in transcript if m["role"] == "assistant"
    ]
    runs = policy_runs(s)
    assert [tok.decode(r) for r in runs] == [x[: -len("\n")] for x in expected_replies]
    assert tok.decode(s.input_ids) == "".join(t.render_message(m) for m in transcript)[: -len("\n")]
    assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)
    assert all(lp == 0.0 for lp, m in zip(s.behav_logprobs, s.loss_mask) if not m)
    assert s.prompt_len == s.loss_mask.index(1)


def test_calculator_agent_groups_are_written_as_graded_shards(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=0)
    with AgentRunner(
        engine, tok, calculator_agent, store=store, group_size=2, batch_groups=3, eta=0, worker_id="agent-0"
    ) as runner:
        stats = asyncio.run(runner.run(train[:3], num_groups=3))
    assert stats["groups_started"] == 3 and stats["episodes"] == 6 and stats["episodes_failed"] == 0
    assert stats["mean_reward"] == 1.0
    shards = shard_rows(store, "graded")
    assert len(shards) == 3 and not store.find("trajectories/ungraded")
    by_prompt = {t["prompt_id"]: t for t in train}
    seen_groups = set()
    for rows in shards.values():
        assert len(rows) == 2 and rows[0].group_id == rows[1].group_id
        seen_groups.add(rows[0].group_id)
        for s in rows:
            assert s.reward == 1.0 and s.worker_id == "agent-0" and s.min_version() == 0
            assert_perfect_calculator_row(tok, s, by_prompt[s.prompt_id])
    assert seen_groups == {f"agent-0-g{g:07d}" for g in range(3)}
    assert sum(1 for rows in shards.values() for s in rows if s.num_turns > 2) > 0  # multi-step tool use


def test_admission_holds_new_groups_until_a_newer_policy(data):
    """B=2, η=0: at version 0 only 2 groups may start; the rest wait for version 1."""
    tok, train, _ = data
    engine = ScriptedEngine(tok, scripted_calculator_reply, version=0)
    written: list[list[Sample]] = []
    with AgentRunner(engine, tok, calculator_agent, group_size=2, batch_groups=2, eta=0) as runner:

        async def bump_when_blocked():
            while not (runner.stats.admission_waits > 3 and len(written) == 2):
                await asyncio.sleep(0.01)
            assert runner.started == 2  # held at (v + η + 1)·B = 2
            engine.version = 1

        async def main():
            bump = asyncio.create_task(bump_when_blocked())
            stats = await runner.run(train, num_groups=4, on_group=written.append)
            await bump
            return stats

        stats = asyncio.run(main())
    assert stats["groups_started"] == 4 and len(written) == 4
    versions = sorted({s.min_version() for g in written for s in g})
    assert versions == [0, 1]
    by_group = {g[0].group_id: {s.min_version() for s in g} for g in written}
    assert by_group["agent-0-g0000000"] == by_group["agent-0-g0000001"] == {0}
    assert by_group["agent-0-g0000002"] == by_group["agent-0-g0000003"] == {1}


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
    with AgentRunner(engine, tok, agent_with_two_conversations, store=store, group_size=2, admission=False) as r:
        stats = asyncio.run(r.run(train, num_groups=1))
    assert stats["rows"] == 4 and stats["episodes_empty"] == 0
    rows = [s for rows in shard_rows(store, "graded").values() for s in rows]
    assert sorted(tok.decode(s.input_ids).split("\n")[1].split(":")[0] for s in rows) == [
        "planner",
        "planner",
        "solver",
        "solver",
    ]
    assert all(s.reward == 0.5 and s.group_id == "agent-0-g0000000" for s in rows)
    assert len({s.sample_id for s in rows}) == 4


def test_unrewarded_failed_and_empty_episodes(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)

    def run(agent, worker_id, **kw):
        with AgentRunner(
            engine, tok, agent, store=store, worker_id=worker_id, group_size=2, admission=False, **kw
        ) as r:
            return asyncio.run(r.run(train, num_groups=1))

    s = run(agent_returns_none, "agent-none")
    assert (
        s["rows"] == 2
        and store.find("trajectories/ungraded/agent-none")
        and not store.find("trajectories/graded/agent-none")
    )
    assert all(row.reward is None for rows in shard_rows(store, "ungraded").values() for row in rows)
    s = run(agent_fails_midway, "agent-fail")
    assert s["episodes_failed"] == 2 and s["rows"] == 0
    assert not [p for p in store.find("trajectories") if "agent-fail" in p]
    s = run(agent_never_calls, "agent-empty")
    assert s["episodes_empty"] == 2 and s["rows"] == 0
    s = run(agent_rewards_per_turn, "agent-turns", turn_discount=0.5)
    rows = [row for p, rows in shard_rows(store, "graded").items() if "agent-turns" in p for row in rows]
    assert len(rows) == 2
    for row in rows:  # r0 = 0.5, final 1.0 on turn 1: G0 = 0.5 + 0.5 * 1.0
        assert row.reward == 1.0 and row.reward_info["turn_returns"] == [1.0, 1.0] and row.num_turns == 2


def test_restarted_runner_continues_after_its_shards(data, tmp_path):
    tok, train, _ = data
    store = Store(str(tmp_path / "run"))
    engine = ScriptedEngine(tok, scripted_calculator_reply)
    kw = dict(store=store, group_size=2, batch_groups=2, eta=0)
    with AgentRunner(engine, tok, calculator_agent, **kw) as r:
        asyncio.run(r.run(train, num_groups=2))
    with AgentRunner(engine, tok, calculator_agent, **kw) as r:
        assert r.started == 2 and r.room() == 0  # both groups of version 0 are already out
        engine.version = 1
        asyncio.run(r.run(train, num_groups=2))
    groups = sorted({s.group_id for rows in shard_rows(store, "graded").values() for s in rows})
    assert groups == [f"agent-0-g{g:07d}" for g in range(4)]
    assert len(store.find("trajectories/graded/agent-0")) == 4


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
    with AgentRunner(engine, tok, langchain_calculator_agent, store=store, group_size=1, admission=False) as r:
        stats = asyncio.run(r.run(tasks, num_groups=2))
    assert stats["episodes_failed"] == 0 and stats["mean_reward"] == 1.0
    rows = [s for rows in shard_rows(store, "graded").values() for s in rows]
    assert len(rows) == 2
    by_prompt = {t["prompt_id"]: t for t in tasks}
    for s in rows:
        assert_perfect_calculator_row(tok, s, by_prompt[s.prompt_id])


def test_agent_rollout_worker_follows_weights_and_stops_at_done(tiny_overrides):
    """The rollout role for agents on a prepared run: admission against weights/LATEST, then DONE."""
    from areal_core.models import load_pretrained
    from areal_core.run import pipeline
    from areal_core.store import INIT_MODEL
    from areal_core.weights.publisher import hf_side_files, publish, state_dict_bytes

    run_uri, _ = pipeline.prepare("", [*tiny_overrides, "train.eta=0", "rollout.group_size=2"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    model, tok = load_pretrained(store.url(INIT_MODEL))
    side = hf_side_files(model, tok)
    publish(store, 0, state_dict_bytes(model), side)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run_agent_rollout_worker(run_uri, 0, episode_timeout_s=60)))
    worker.start()

    def groups() -> set[str]:
        return {
            s.group_id for p in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(p))
        }

    deadline = time.time() + 60
    while len(groups()) < 2 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert len(groups()) == 2  # (0 + η + 1)·B with B=2, η=0
    publish(store, 1, state_dict_bytes(model), side)
    while len(groups()) < 4 and time.time() < deadline:
        time.sleep(0.1)
    store.write_text("DONE", "")
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert result["groups_started"] == 4 and len(groups()) == 4
    rows = [s for p in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(p))]
    assert len(rows) == 8 and all(s.reward in (0.0, 1.0) for s in rows)
    assert sorted({s.min_version() for s in rows}) == [0, 1]
    assert store.statuses()["rollout-agent-0"]["groups_started"] == 4
