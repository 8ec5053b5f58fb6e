"""Held-out evaluation: greedy accuracy (the task verifier over greedy completions of the
built-in engine), or for agent runs the agent's success rate through an in-process proxy. A
vision-language model answers each held-out question with its images (`meta.image_ids`, read by
id from `images`)."""

from __future__ import annotations

from typing import Any

import torch

from areal_core.models import record_prompt
from areal_core.reward.pool import DEFAULT_REWARD, RewardPool, reward_function
from areal_core.reward.signatures import reward_job
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.vlm.images import ImageCache
from areal_core.vlm.records import record_image_ids
from areal_core.vlm_processor import VisionProcessor

ANSWER_CHARS = 2000  # of a question, reference or answer kept for the report (a text run's long ones)


@torch.no_grad()
def greedy_answers(
    model,
    tokenizer,
    records: list[dict[str, Any]],
    max_new_tokens: int,
    batch_size: int,
    reward_fn: str = DEFAULT_REWARD,
    timeout_s: float = 30.0,
    system: str = "",
    images: ImageCache | None = None,
    prompt_format: str = "chat",
) -> list[tuple[str, float]]:
    """(greedy completion, verifier score) of each record, in order.

    `reward_fn` is an import path; every call runs in a RewardPool process with `timeout_s`
    (a call past it is killed and scores 0), as in the reward workers. `images`: where the
    records' images are read (a VLM, whose processor `tokenizer` is)."""
    if not records:
        raise ValueError("no held-out records to evaluate")
    was_training = model.training
    engine = TorchEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    out: list[tuple[str, float]] = []
    with RewardPool(reward_fn, size=1, timeout_s=timeout_s, retries=0) as pool:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            prompts, mm = zip(*(encode(tokenizer, r, system, images, prompt_format) for r in chunk))
            if any(m is not None for m in mm):
                gens = engine.generate(list(prompts), params, mm=list(mm))
            else:
                gens = engine.generate(list(prompts), params)
            texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
            jobs = [reward_job(text, r, completion_ids=g.token_ids) for r, text, g in zip(chunk, texts, gens)]
            out += [(text, res.reward) for text, res in zip(texts, pool.grade(jobs))]
    model.train(was_training)
    return out


def greedy_accuracy(
    model, tokenizer, records: list[dict[str, Any]], max_new_tokens: int, batch_size: int, **kw: Any
) -> float:
    """Mean verifier score of greedy completions (for math: the fraction answered correctly);
    `kw` as `greedy_answers`."""
    answers = greedy_answers(model, tokenizer, records, max_new_tokens, batch_size, **kw)
    return sum(reward for _, reward in answers) / len(records)


def answer_record(record: dict[str, Any], completion: str, reward: float) -> dict[str, Any]:
    """One held-out answer as the run report shows it (`Layout.heldout_answers`): the question,
    its images by id, the reference, the model's greedy answer and the verifier's verdict."""
    return {
        "prompt_id": str(record.get("prompt_id", "")),
        "question": str(record.get("prompt", ""))[:ANSWER_CHARS],
        "image_ids": record_image_ids(record),
        "reference": str(record.get("answer", ""))[:ANSWER_CHARS],
        "answer": completion[:ANSWER_CHARS],
        "reward": float(reward),
        "correct": reward >= 1.0,
    }


def encode(
    tokenizer, record: dict[str, Any], system: str, images: ImageCache | None, prompt_format: str = "chat"
) -> tuple[list[int], Any]:
    """The record's prompt ids (task.prompt_format) and its images as MMInputs (None: a text prompt)."""
    ids = record_image_ids(record)
    if not ids:
        return record_prompt(tokenizer, record, system, prompt_format), None
    if not isinstance(tokenizer, VisionProcessor) or images is None:
        raise ValueError(f"held-out prompt {record.get('prompt_id')!r} has images: evaluate a VLM with its images")
    return tokenizer.encode(record["prompt"], images.load(ids), system)


def agent_success(model, tokenizer, agent: str, records: list[dict[str, Any]], max_new_tokens: int, **kw: Any) -> float:
    """Held-out agent success: mean reward of one greedy episode per record, the agent talking to
    an in-process proxy over `model` (areal_core.proxy.agent_workflow.evaluate_agent)."""
    import asyncio

    from areal_core.proxy.agent_workflow import evaluate_agent

    if not records:
        raise ValueError("no held-out records to evaluate")
    was_training = model.training
    model.eval()
    engine = TorchEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, temperature=0.0)
    try:
        return asyncio.run(evaluate_agent(engine, tokenizer, agent, records, sampling=params, **kw))
    finally:
        model.train(was_training)


def heldout_score(model, tokenizer, cfg: Any, records: list[dict[str, Any]], images: ImageCache | None = None) -> float:
    """The run's held-out metric: agent success when `rollout.agent` is set, else greedy accuracy
    under the configured verifier (`images`: the run's, for a VLM)."""
    return heldout_eval(model, tokenizer, cfg, records, images)[0]


def heldout_eval(
    model, tokenizer, cfg: Any, records: list[dict[str, Any]], images: ImageCache | None = None, keep: int = 0
) -> tuple[float, list[dict[str, Any]]]:
    """`heldout_score`, and the answers to the first `keep` records (`answer_record`) from the same
    greedy pass, so the report's before/after answers are the ones that were scored (an agent
    run records none: its episodes are conversations, not one answer)."""
    if cfg.rollout.agent:
        score = agent_success(
            model,
            tokenizer,
            cfg.rollout.agent,
            records,
            cfg.eval.max_new_tokens,
            max_concurrent_episodes=cfg.agent.max_concurrent_episodes,
            tool_prompt=cfg.agent.tool_prompt,
            mcp=cfg.agent,  # its MCP servers, when it has any (agent.mcp_servers)
        )
        return score, []
    answers = greedy_answers(
        model,
        tokenizer,
        records,
        cfg.eval.max_new_tokens,
        cfg.eval.batch_size,
        reward_function(cfg),
        cfg.reward.timeout_s,
        cfg.task.system_prompt,
        images,
        cfg.task.prompt_format,
    )
    kept = [answer_record(r, text, reward) for r, (text, reward) in zip(records[:keep], answers)]
    return sum(reward for _, reward in answers) / len(records), kept
