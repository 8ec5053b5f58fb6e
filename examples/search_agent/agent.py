"""The search agent (ASearcher-style): search, read, answer with a citation.

    rollout.agent: examples.search_agent.agent:search_agent      (configs/agent_search.yaml)

`search_agent` runs the MCP tool loop (areal_core/agents/loop.py) over the search server's
`search` and `read` tools and returns its reward: 0.8 for the exact answer (`#### <answer>`),
plus 0.2 for citing (`[d0042]`) the document that holds the fact, read in this episode.
`search_transcript` is the ideal episode (search, read, per hop; then the answer), rendered by
`search_sft_examples` through the proxy's own template for the warm start; `search_corpus` is the
tiny tokenizer's text (documents, questions, tool calls).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from areal_core.agents.loop import tool_loop
from areal_core.agents.tools import EpisodeTools
from examples.search_agent.kb import KnowledgeBase, SearchEngine, from_record

ANSWER_WEIGHT, CITE_WEIGHT = 0.8, 0.2
_FINAL = re.compile(r"\s*(.*?)\s*(?:\[\s*([^\]\s]+)\s*\])?\s*", re.DOTALL)


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .")


def parse_final(final: str) -> tuple[str, str]:
    """(answer, cited doc id) of `#### <answer> [<doc id>]` (the last `####`); ('', '') without one."""
    if "####" not in final:
        return "", ""
    m = _FINAL.fullmatch(final.rsplit("####", 1)[1])
    return (m.group(1), m.group(2) or "") if m else ("", "")


def search_reward(final: str, task: dict[str, Any], read_texts: dict[str, str]) -> float:
    """0.8 * exact match + 0.2 * (the cited document is the one holding the fact, it was read in
    this episode and its text states the answer). `read_texts`: doc id -> the text `read` returned."""
    task = from_record(task)
    answer, cited = parse_final(final)
    exact = bool(answer) and _norm(answer) == _norm(task["answer"])
    text = read_texts.get(cited, "")
    cites = cited == task["meta"]["support"] and _norm(task["answer"]) in _norm(text)
    return ANSWER_WEIGHT * exact + CITE_WEIGHT * cites


async def search_agent(
    task: dict[str, Any], base_url: str, api_key: str, tools: EpisodeTools | None = None, max_turns: int = 6
) -> float:
    result = await tool_loop(
        [{"role": "user", "content": task["prompt"]}], base_url, api_key, tools, max_turns=max_turns
    )
    read = {
        str(c.arguments.get("doc_id", "")).strip(): c.text
        for c in (tools.calls if tools else [])
        if c.name == "read" and c.arguments and not c.event
    }
    return search_reward(result.final if result.stopped == "answer" else "", task, read)


# -- the warm start ----------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def engine_for(seed: int, people: int) -> SearchEngine:
    return SearchEngine(KnowledgeBase.build(seed, people))


def _call(k: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{k}", "type": "function", "function": fn}],
    }


def search_transcript(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The ideal episode: per hop, search the entity and read its document; then the answer."""
    task = from_record(task)
    meta = task["meta"]
    engine = engine_for(meta["kb_seed"], meta["kb_people"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    for name, doc_id in meta["steps"]:
        for tool, args, result in (
            ("search", {"query": name}, engine.search(name)),
            ("read", {"doc_id": doc_id}, engine.read(doc_id)),
        ):
            messages.append(_call(len(messages), tool, args))
            messages.append({"role": "tool", "tool_call_id": f"call_{len(messages) - 1}", "content": result})
    messages.append({"role": "assistant", "content": f"#### {task['answer']} [{meta['support']}]"})
    return messages


def search_sft_examples(tokenizer: Any, records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each record's ideal episode, as the proxy stores it (tool_prompt none)."""
    from areal_core.proxy.templating import ChatTemplate

    t = ChatTemplate(tokenizer, tool_prompt="none")
    return [t.episode(search_transcript(r)) for r in records]


def search_corpus(records: list[dict[str, Any]]) -> list[str]:
    """The tiny tokenizer's training text: the knowledge base, the questions and the ideal episodes' text."""
    from areal_core.proxy.templating import tool_call_text

    texts: list[str] = []
    records = [from_record(r) for r in records]
    for seed, people in sorted({(r["meta"]["kb_seed"], r["meta"]["kb_people"]) for r in records}):
        texts += [d.text for d in engine_for(seed, people).kb.docs.values()]
    for r in records:
        for m in search_transcript(r):
            if m.get("tool_calls"):
                fn = m["tool_calls"][0]["function"]
                texts.append(tool_call_text(fn["name"], json.loads(fn["arguments"])))
            elif m.get("content"):
                texts.append(m["content"])
    return texts
