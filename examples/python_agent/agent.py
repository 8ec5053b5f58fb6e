"""The Python-interpreter agent: it runs code in the sandbox (an MCP server) before answering.

    rollout.agent: examples.python_agent.agent:python_agent      (configs/agent_python.yaml)

Tasks the tiny model cannot do in its head (`generate`): products of large numbers and sums of
lists. The agent runs the MCP tool loop over the `run_python` tool and returns the task's
verifier: 1.0 for the exact number after `####`. `python_transcript` is the ideal episode (one
`print(...)` call, then the answer) for the warm start (`python_sft_examples`), `python_corpus`
the tiny tokenizer's text.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from areal_core.agents.loop import tool_loop
from areal_core.agents.tools import EpisodeTools

_NUMBER = re.compile(r"####\s*(-?\d+)")


def generate(seed: int, num_train: int, num_eval: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Products of a 3-4 digit and a 2-3 digit number, and sums of 4-6 two-digit numbers."""
    rng = random.Random(f"python-{seed}")

    def one(split: str, k: int) -> dict[str, Any]:
        if rng.random() < 0.5:
            a, b = rng.randint(100, 9999), rng.randint(10, 999)
            prompt, expr, value = f"What is {a} * {b}?", f"{a}*{b}", a * b
        else:
            xs = [rng.randint(10, 99) for _ in range(rng.randint(4, 6))]
            prompt, expr, value = (
                f"What is the sum of {', '.join(map(str, xs))}?",
                f"sum([{', '.join(map(str, xs))}])",
                sum(xs),
            )
        return {
            "prompt_id": f"python-{split}-{k:05d}",
            "prompt": prompt,
            "answer": str(value),
            "meta": {"code": f"print({expr})"},
        }

    return [one("train", k) for k in range(num_train)], [one("eval", k) for k in range(num_eval)]


def to_row(task: dict[str, Any]) -> dict[str, str]:
    """A task as a GSM8K-style `{question, answer}` line: `answer` is `<code> #### <value>`."""
    return {"question": task["prompt"], "answer": f"{task['meta']['code']} #### {task['answer']}"}


def from_record(record: dict[str, Any]) -> dict[str, Any]:
    """A task as `generate` gives it, from itself or from a record read from the JSONL form."""
    if "code" in (record.get("meta") or {}):
        return record
    code, _, value = str(record["answer"]).rpartition(" #### ")
    return {**record, "answer": value.strip(), "meta": {**(record.get("meta") or {}), "code": code.strip()}}


def python_reward(final: str, task: dict[str, Any]) -> float:
    task = from_record(task)
    m = _NUMBER.search(final or "")
    return float(m is not None and m.group(1) == task["answer"])


async def python_agent(
    task: dict[str, Any], base_url: str, api_key: str, tools: EpisodeTools | None = None, max_turns: int = 4
) -> float:
    result = await tool_loop(
        [{"role": "user", "content": task["prompt"]}], base_url, api_key, tools, max_turns=max_turns
    )
    return python_reward(result.final if result.stopped == "answer" else "", task)


def python_transcript(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The ideal episode: print the value with one cell, then answer it."""
    task = from_record(task)
    fn = {"name": "run_python", "arguments": json.dumps({"code": task["meta"]["code"]})}
    return [
        {"role": "user", "content": task["prompt"]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": "call_1", "content": task["answer"]},
        {"role": "assistant", "content": f"#### {task['answer']}"},
    ]


def python_sft_examples(tokenizer: Any, records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    from areal_core.proxy.templating import ChatTemplate

    t = ChatTemplate(tokenizer, tool_prompt="none")
    return [t.episode(python_transcript(r)) for r in records]


def python_corpus(records: list[dict[str, Any]]) -> list[str]:
    from areal_core.proxy.templating import tool_call_text

    texts = []
    for r in map(from_record, records):
        texts += [r["prompt"], f"#### {r['answer']}", tool_call_text("run_python", {"code": r["meta"]["code"]})]
    return texts
