"""Example agents for the proxy, on the arithmetic task, and a scripted stand-in policy.

- `calculator_agent`: a multi-turn tool-using agent written with the plain `openai` SDK.
  It offers a `calculator` tool; the model calls it (the proxy's `<tool_call>` convention
  becomes OpenAI `tool_calls`), the agent evaluates the expression and returns the result as
  a `role: "tool"` message, until the model answers `#### N`. Its reward is the task's
  verifier (1.0 for the right final number).
- `langchain_calculator_agent`: the same agent with LangChain's `ChatOpenAI` (needs the
  optional `langchain-openai` package).
- `calculator_transcript` / `calculator_sft_examples`: the ideal episode of a problem, for a
  warm start that teaches the tiny model the tool format (token ids + loss mask, rendered by
  the proxy's own template so SFT and serving agree token for token).
- `ScriptedEngine`: a deterministic RolloutEngine that answers with scripted text; a reply
  function of the prompt text decides what it says. For demos and tests of agent plumbing
  without a trained model.

Agents join training by being run with a base_url and an API key: see docs/proxy.md.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from areal_core.reward.math import gsm8k_reward
from areal_core.rollout.engine import Generation, SamplingParams

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 23+45"}},
            "required": ["expression"],
        },
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or 'error: ...'. No names, calls or powers."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if abs(a) > 1e12 or abs(b) > 1e12:
                raise ValueError("number too large")
            return _OPS[type(node.op)](a, b)
        raise ValueError(f"unsupported {type(node).__name__}")

    try:
        if len(expression) > 200:
            raise ValueError("expression too long")
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _expression_of(arguments: str | dict) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return str(arguments)
    return str(args.get("expression", "")) if isinstance(args, dict) else str(args)


async def calculator_agent(
    task: dict[str, Any],
    base_url: str,
    api_key: str,
    max_turns: int = 4,
    http_client: Any = None,
    temperature: float | None = None,
) -> float:
    """Multi-turn calculator-tool agent with the openai SDK; returns the task reward. `http_client`: an
    httpx.AsyncClient for the SDK (closed with it: a traffic simulator's timing one); `temperature`:
    sent with every request when given (else the server's default)."""
    from openai import AsyncOpenAI, BadRequestError

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120, http_client=http_client)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    extra = {} if temperature is None else {"temperature": temperature}
    final = ""
    try:
        for _ in range(max_turns):
            try:
                resp = await client.chat.completions.create(
                    model="areal-policy", messages=messages, tools=[CALCULATOR_TOOL], **extra
                )
            except BadRequestError:  # the episode outgrew the context
                break
            msg = resp.choices[0].message
            messages.append(msg)
            if not msg.tool_calls:
                final = msg.content or ""
                break
            for call in msg.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": calculate(_expression_of(call.function.arguments)),
                    }
                )
    finally:
        await client.close()
    return gsm8k_reward(final, task["answer"])


async def langchain_calculator_agent(task: dict[str, Any], base_url: str, api_key: str, max_turns: int = 4) -> float:
    """The calculator agent with LangChain's ChatOpenAI: only base_url and api_key point at the proxy."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="areal-policy", base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    agent = llm.bind_tools([CALCULATOR_TOOL])
    messages: list[Any] = [HumanMessage(task["prompt"])]
    final = ""
    for _ in range(max_turns):
        ai = await agent.ainvoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            final = ai.content if isinstance(ai.content, str) else ""
            break
        for call in ai.tool_calls:
            messages.append(ToolMessage(calculate(_expression_of(call["args"])), tool_call_id=call["id"]))
    return gsm8k_reward(final, task["answer"])


# ---------------------------------------------------------------------------------------------
# The ideal episode, for a warm start
# ---------------------------------------------------------------------------------------------
_LINE = re.compile(r"^\s*([\d+\-*/ ()]+?)\s*=\s*(-?\d+)\s*$")


def calculator_transcript(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a perfect episode: one calculator call per worked line, then `#### N`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": record["prompt"]}]
    lines = record["answer"].split("####")[0].strip().splitlines()
    for k, line in enumerate(lines):
        m = _LINE.match(line)
        if not m:
            continue
        call_id = f"call_{k}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "calculator", "arguments": json.dumps({"expression": m.group(1)})},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": calculate(m.group(1))})
    final = record["answer"].rsplit("####", 1)[1].strip()
    messages.append({"role": "assistant", "content": f"#### {final}"})
    return messages


def calculator_sft_examples(tokenizer: Any, records: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per record: the ideal episode rendered exactly as the proxy stores it
    (tool_prompt "none"), with loss on the assistant tokens and their end token."""
    from areal_core.proxy.templating import ChatTemplate

    t = ChatTemplate(tokenizer, tool_prompt="none")
    return [t.episode(calculator_transcript(r)) for r in records]


def calculator_corpus(records: list[dict[str, Any]]) -> list[str]:
    """Text for training a tokenizer that knows the tool-call format (build_tokenizer's corpus)."""
    from areal_core.proxy.templating import tool_call_text

    texts = []
    for r in records:
        texts.append(r["prompt"] + "\n" + r["answer"])
        for line in r["answer"].split("####")[0].strip().splitlines():
            m = _LINE.match(line)
            if m:
                texts.append(tool_call_text("calculator", {"expression": m.group(1)}))
    return texts


# ---------------------------------------------------------------------------------------------
# A scripted stand-in policy
# ---------------------------------------------------------------------------------------------
class ScriptedEngine:
    """A RolloutEngine whose replies come from `reply(prompt_text) -> str`.

    Each reply is tokenised and ends with EOS (cut to max_new_tokens); its log-probs are a
    deterministic function of position, and every token carries the engine's version.
    """

    def __init__(self, tokenizer: Any, reply: Callable[[str], str], version: int = 0):
        self.tokenizer = tokenizer
        self.reply = reply
        self.version = version
        self.swaps = 0
        self.eos_id = tokenizer.eos_token_id
        self.calls: list[int] = []  # batch size of each generate call

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            text = self.reply(self.tokenizer.decode(p, skip_special_tokens=False))
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]
            reason = "stop"
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            lps = [-0.01 * (1 + (i % 7)) for i in range(len(ids))]
            out.append(Generation(ids, lps, [self.version] * len(ids), reason))
        return out

    def load_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def health(self) -> dict:
        return {"ok": True, "version": self.version}


_QUESTION = re.compile(r"has (\d+) \w+ and (.*?)\. How many")
_CLAUSE = re.compile(r"gets (\d+) more|gives away (\d+)|makes it (\d+) times as many")


def scripted_calculator_reply(prompt_text: str) -> str:
    """A perfect calculator policy for 1..3-step arithmetic problems, reading the prompt text:
    call the calculator for the next step, or give `#### N` after the last tool result."""
    users = prompt_text.split("<|im_start|>user\n")
    question = users[-1].split("<|im_end|>")[0] if len(users) > 1 else prompt_text
    m = _QUESTION.search(question)
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", users[-1], re.DOTALL)
    if not m:
        return "I cannot parse this question."
    value = int(results[-1]) if results else int(m.group(1))
    steps = _CLAUSE.findall(m.group(2))
    if len(results) >= len(steps):
        return f"#### {value}"
    add, sub, mul = steps[len(results)]
    expr = f"{value}+{add}" if add else f"{value}-{sub}" if sub else f"{value}*{mul}"
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


def sft_calculator(
    model: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    steps: int = 100,
    lr: float = 1e-2,
    batch_size: int = 16,
    seed: int = 0,
) -> float:
    """Warm start: teach `model` the calculator episode format (loss on assistant tokens only).

    Returns the last batch's loss. The model is left in eval mode.
    """
    import torch

    from areal_core.models import sft_loss

    examples = calculator_sft_examples(tokenizer, records)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        loss = sft_loss(model, batch, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.item())
