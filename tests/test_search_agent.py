"""The search agent: a seeded knowledge base, BM25 ranking (bm25s) that finds the document each
question needs, the citation check in the reward, and the ideal episode through the real MCP
server (a subprocess) and the real proxy, token for token as the warm start renders it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_core.agents.mcp import ServerSpec
from areal_core.agents.tools import MCPEnvironment
from areal_core.agents.workflow import MCPWorkflow
from areal_core.models import build_tokenizer
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.templating import ChatTemplate, tool_call_text
from examples.search_agent.agent import search_agent, search_corpus, search_reward, search_transcript
from examples.search_agent.kb import KnowledgeBase, SearchEngine, questions

SEED, PEOPLE = 3, 120


@pytest.fixture(scope="module")
def kb():
    return KnowledgeBase.build(SEED, PEOPLE)


@pytest.fixture(scope="module")
def qs(kb):
    return questions(kb, 60, 20, seed=SEED)


def test_the_knowledge_base_is_seeded_and_held_out_people_are_new(kb, qs):
    again = KnowledgeBase.build(SEED, PEOPLE)
    assert again.docs == kb.docs and KnowledgeBase.build(SEED + 1, PEOPLE).docs != kb.docs
    assert len(kb.docs) == PEOPLE + PEOPLE // 5 and len({d.title for d in kb.docs.values()}) == len(kb.docs)
    train, held_out = qs
    asked = {q["meta"]["steps"][0][0] for q in train}
    assert not asked & {q["meta"]["steps"][0][0] for q in held_out}
    assert {q["meta"]["hops"] for q in train} == {1, 2}
    for q in train + held_out:  # the answer is in the support document, never in a snippet
        doc = kb.docs[q["meta"]["support"]]
        assert q["answer"] in doc.text and q["answer"] not in doc.snippet


def test_ranking_finds_each_questions_document(kb, qs):
    engine = SearchEngine(kb)
    steps = [s for q in qs[0] + qs[1] for s in q["meta"]["steps"]]
    top1 = sum(engine.ranked(name)[:1] == [doc] for name, doc in steps)
    assert all(doc in engine.ranked(name, 3) for name, doc in steps)
    assert top1 >= 0.95 * len(steps)
    name, doc = steps[0]
    assert engine.search(name).splitlines()[0] == f"{doc} {kb.docs[doc].title}: {kb.docs[doc].snippet}"
    assert engine.search("the of a") == "no results" and engine.read(" nope ").startswith("error: no document")


def test_the_reward_checks_the_answer_and_the_citation(kb, qs):
    q = next(q for q in qs[0] if q["meta"]["hops"] == 2)
    support, other = q["meta"]["support"], q["meta"]["steps"][0][1]
    read = {support: kb.docs[support].text, other: kb.docs[other].text}
    assert search_reward(f"#### {q['answer']} [{support}]", q, read) == 1.0
    assert search_reward(f"#### {q['answer'].upper()}  [ {support} ]", q, read) == 1.0
    assert search_reward(f"#### {q['answer']} [{support}]", q, {other: read[other]}) == 0.8  # never read it
    assert search_reward(f"#### {q['answer']} [{other}]", q, read) == 0.8  # read, but not where the fact is
    assert search_reward(f"#### {q['answer']}", q, read) == 0.8
    assert search_reward(f"#### Nowhere [{support}]", q, read) == pytest.approx(0.2)
    assert search_reward(f"{q['answer']} [{support}]", q, read) == 0.0  # no `####`


def test_the_ideal_episode_through_the_mcp_server_and_the_proxy(kb, qs):
    torch.set_num_threads(1)
    train = [q for q in qs[0] if q["meta"]["hops"] == 2][:1] + [q for q in qs[0] if q["meta"]["hops"] == 1][:1]
    for q in train:  # the KB of these questions is the server's: (SEED, PEOPLE)
        assert (q["meta"]["kb_seed"], q["meta"]["kb_people"]) == (SEED, PEOPLE)
    tok = build_tokenizer(search_corpus(train), 400)
    replies = {}
    for q in train:
        transcript = search_transcript(q)
        replies[q["prompt"]] = [
            tool_call_text(m["tool_calls"][0]["function"]["name"], eval_args(m))
            if m.get("tool_calls")
            else m["content"]
            for m in transcript
            if m["role"] == "assistant"
        ]

    def reply(prompt_text: str) -> str:
        question = prompt_text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return replies[question][prompt_text.count("<|im_start|>tool\n")]

    spec = ServerSpec(
        "search",
        command="python",
        args=("-m", "examples.search_agent.server", "--seed", str(SEED), "--people", str(PEOPLE)),
        stateless=True,
    )
    env = MCPEnvironment([spec], max_calls=6)
    workflow = MCPWorkflow(tok, search_agent, mcp=env, group_size=1)
    engine = ScriptedEngine(tok, reply)

    async def main():
        try:
            return [await workflow.run_episode(engine, q) for q in train]
        finally:
            await env.aclose()

    try:
        results = asyncio.run(main())
    finally:
        workflow.close()
    template = ChatTemplate(tok, tool_prompt="none")
    for q, r in zip(train, results):
        assert r.error is None and r.reward == 1.0
        (row,) = r.samples
        assert (row.input_ids, row.loss_mask) == template.episode(search_transcript(q))  # SFT == serving
        assert row.num_turns == 2 * q["meta"]["hops"] + 1
    assert workflow.stats()["mcp"]["outcomes"] == {"ok": 2}


def eval_args(message: dict) -> dict:
    import json

    return json.loads(message["tool_calls"][0]["function"]["arguments"])


def test_the_questions_survive_the_gsm8k_jsonl_form(kb, qs, tmp_path):
    """`task.name: gsm8k` reads the JSONL `examples.search_agent.data` writes; the records it gives
    carry everything the reward and the warm start need."""
    import json

    from examples.search_agent.kb import from_record, to_row
    from task_data.gsm8k import load_split

    train = qs[0][:10]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(to_row(q)) + "\n" for q in train))
    for q, rec in zip(train, load_split(str(tmp_path), "train")):
        back = from_record(rec)
        assert back["prompt"] == q["prompt"] and back["answer"] == q["answer"]
        assert {k: back["meta"][k] for k in ("support", "kb_seed", "kb_people")} == {
            k: q["meta"][k] for k in ("support", "kb_seed", "kb_people")
        }
        assert search_transcript(back) == search_transcript(q)


def test_held_out_success_through_the_runs_agent_section_and_its_mcp_server(kb, qs, monkeypatch):
    """The evaluate step's score: `heldout_score` hands the run's `agent` section (its MCP servers)
    to the episodes; the ideal agent scores 1 on held-out questions, without the servers 0."""
    from areal_core import evaluate
    from areal_core.config import RunConfig
    from areal_core.proxy.agent_workflow import evaluate_agent

    held_out = qs[1][:2]
    tok = build_tokenizer(search_corpus(held_out), 400)
    replies = {
        q["prompt"]: [
            tool_call_text(m["tool_calls"][0]["function"]["name"], eval_args(m))
            if m.get("tool_calls")
            else m["content"]
            for m in search_transcript(q)
            if m["role"] == "assistant"
        ]
        for q in held_out
    }

    def reply(prompt_text: str) -> str:
        question = prompt_text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return replies[question][prompt_text.count("<|im_start|>tool\n")]

    server = {"name": "search", "command": "python", "stateless": True,
              "args": ["-m", "examples.search_agent.server", "--seed", str(SEED), "--people", str(PEOPLE)]}  # fmt: skip
    cfg = RunConfig.model_validate(
        {"rollout": {"agent": "examples.search_agent.agent:search_agent"}, "agent": {"mcp_servers": [server]}}
    )

    def scripted(model, tokenizer, agent, records, max_new_tokens, **kw):
        return asyncio.run(evaluate_agent(ScriptedEngine(tokenizer, reply), tokenizer, agent, records, **kw))

    monkeypatch.setattr(evaluate, "agent_success", scripted)
    assert evaluate.heldout_score(None, tok, cfg, held_out) == 1.0
    no_servers = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"mcp_servers": []})})
    assert evaluate.heldout_score(None, tok, no_servers, held_out) == 0.0


def test_the_breakdown_splits_success_by_hops_and_by_searching(kb, qs):
    """benchmarks/search_agent_breakdown.py: an episode that searches and reads is counted as
    searched, one that answers at once as plain, each under its question's hops."""
    from areal_core.config import RunConfig
    from benchmarks.search_agent_breakdown import breakdown, model_path, score_episodes

    one_hop = next(q for q in qs[1] if q["meta"]["hops"] == 1)
    two_hop = next(q for q in qs[1] if q["meta"]["hops"] == 2)
    tok = build_tokenizer(search_corpus([one_hop, two_hop]), 400)
    ideal = [
        tool_call_text(m["tool_calls"][0]["function"]["name"], eval_args(m)) if m.get("tool_calls") else m["content"]
        for m in search_transcript(one_hop)
        if m["role"] == "assistant"
    ]

    def reply(prompt_text: str) -> str:
        if one_hop["prompt"] in prompt_text:
            return ideal[prompt_text.count("<|im_start|>tool\n")]
        return "#### nowhere [d0000]"  # answers the two-hop question at once, wrongly

    server = {"name": "search", "command": "python", "stateless": True,
              "args": ["-m", "examples.search_agent.server", "--seed", str(SEED), "--people", str(PEOPLE)]}  # fmt: skip
    cfg = RunConfig.model_validate(
        {
            "rollout": {"agent": "examples.search_agent.agent:search_agent"},
            "agent": {"mcp_servers": [server]},
            "eval": {"max_new_tokens": 64},  # a whole tool call at vocab 400
        }
    )
    rows = score_episodes(ScriptedEngine(tok, reply), tok, cfg, [one_hop, two_hop])
    assert rows == [(1, True, 1.0), (2, False, 0.0)]
    out = breakdown(rows + [(1, True, 0.2), (2, None, 0.0)])
    assert out["1-hop searched"] == {"n": 2, "share": 0.5, "mean": 0.6}
    assert out["2-hop plain"] == {"n": 1, "share": 0.25, "mean": 0.0}
    assert out["2-hop failed"] == {"n": 1, "share": 0.25, "mean": 0.0}
    assert out["all"] == {"n": 4, "share": 1.0, "mean": 0.3}
    from areal_core.layout import LAYOUT

    assert model_path(LAYOUT.init_model) == LAYOUT.init_model
    assert model_path("v000060") == model_path("60") == LAYOUT.weights_dir(60)
    for bad in ("vx", "final", "-3"):
        with pytest.raises(SystemExit, match="not init_model"):
            model_path(bad)
