"""A fast in-process learning probe of the search agent (no role processes): the tiny model of
configs/agent_search.yaml, a warm start on ideal episodes (search, read, answer with a citation),
then synchronous GRPO steps where each step runs B groups of G episodes through the in-process
proxy and the real search MCP server (one stateless subprocess, bm25s), and one update.
Prints held-out success (mean reward: 0.8 exact answer + 0.2 citation), exact-match and
citation rates before RL and every `--eval-every` steps, and the MCP outcome counts.

    PYTHONPATH=. .venv/bin/python benchmarks/search_agent_probe.py --steps 30 --kinds town,year
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for name, typ, default in [
        ("config", str, "configs/agent_search.yaml"),
        ("kinds", str, "town,year"),
        ("people", int, 1500),
        ("num_train", int, 3000),
        ("sft", int, 500),
        ("sft_lr", float, 3e-3),
        ("sft_keep", float, 1.0),
        ("lr", float, 2e-4),
        ("steps", int, 30),
        ("b", int, 4),
        ("g", int, 8),
        ("eval_n", int, 60),
        ("eval_every", int, 10),
        ("temperature", float, 0.7),
        ("seed", int, 1),
        ("show", int, 0),
    ]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=typ, default=default)
    ap.add_argument("--overrides", default="", help="extra config overrides, space separated")
    return ap.parse_args()


def probe_config(a: argparse.Namespace) -> Any:
    """The run config of --config with the probe's lr, η = 0, B groups of G and --overrides."""
    from areal_core.config import load_config

    overrides = [
        "task.path=unused",
        f"train.lr={a.lr}",
        "train.eta=0",
        f"rollout.group_size={a.g}",
        f"train.batch_groups={a.b}",
        f"rollout.temperature={a.temperature}",
        *a.overrides.split(),
    ]
    return load_config(a.config, overrides)


def warm_start(a: argparse.Namespace, model: Any, tok: Any, train: list[dict], out: dict) -> None:
    """--sft AdamW steps on ideal episodes (a --sft-keep share of the training questions), the loss on the
    assistant's tokens; the longest example, the seconds and the last loss go into `out`."""
    from areal_core.models import sft_loss
    from examples.search_agent.agent import search_sft_examples

    t0 = time.time()
    rng = random.Random(a.seed)
    examples = search_sft_examples(tok, rng.sample(train, int(len(train) * a.sft_keep)))
    out["sft_max_tokens"] = max(len(ids) for ids, _ in examples)
    opt = torch.optim.AdamW(model.parameters(), lr=a.sft_lr, weight_decay=0.0)
    model.train()
    for _ in range(a.sft):
        loss = sft_loss(model, rng.sample(examples, min(32, len(examples))), tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    out["sft_s"], out["sft_loss"] = round(time.time() - t0, 1), round(float(loss), 4)


def search_environment(a: argparse.Namespace, cfg: Any) -> Any:
    """The real search MCP server (one stateless subprocess over the probe's knowledge base) as an environment."""
    from areal_core.agents.mcp import ServerSpec
    from areal_core.agents.tools import MCPEnvironment

    spec = ServerSpec(
        "search",
        command="python",
        args=("-m", "examples.search_agent.server", "--seed", str(a.seed), "--people", str(a.people)),
        stateless=True,
        call_timeout_s=cfg.agent.mcp_call_timeout_s,
    )
    return MCPEnvironment([spec], max_calls=cfg.agent.mcp_max_calls)


class SearchProbe:
    """Synchronous GRPO on the search agent: a sampling workflow of G episodes a task, a greedy one for the
    held-out evaluation, both over one engine and one MCP environment; results go into `out`."""

    def __init__(self, a: argparse.Namespace, cfg: Any, model: Any, tok: Any, out: dict) -> None:
        from areal_core.agents.workflow import MCPWorkflow
        from areal_core.rollout.engine import SamplingParams
        from areal_core.rollout.torch_engine import TorchEngine
        from examples.search_agent.agent import search_agent

        self.a, self.cfg, self.model, self.tok, self.out = a, cfg, model, tok, out
        self.env = search_environment(a, cfg)
        self.engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, seed=7)
        max_new = cfg.rollout.max_new_tokens
        kw = {"mcp": self.env, "tool_prompt": cfg.agent.tool_prompt}
        self.rollout = MCPWorkflow(
            tok,
            search_agent,
            group_size=a.g,
            sampling=SamplingParams(max_new_tokens=max_new, temperature=a.temperature),
            **kw,
        )
        self.greedy = MCPWorkflow(
            tok,
            search_agent,
            group_size=1,
            sampling=SamplingParams(max_new_tokens=max_new, greedy=True, temperature=0.0),
            **kw,
        )

    async def evaluate(self, step: int, held: list[dict]) -> None:
        """Greedy success, exact-match and citation rates on `held` at `step`, and the MCP outcome counts."""
        out = self.out
        results = [await self.greedy.run_episode(self.engine, t) for t in held]
        rewards = [r.reward or 0.0 for r in results]
        for r in results[: self.a.show]:  # what the greedy policy did, whole
            print(self.tok.decode(r.samples[0].input_ids) if r.samples else r.error, flush=True)
        n = len(rewards)
        out["success"][step] = round(sum(rewards) / n, 3)
        out["exact"][step] = round(sum(r >= 0.8 - 1e-6 for r in rewards) / n, 3)
        out["cited"][step] = round(sum(abs(r - 0.2) < 1e-6 or r > 0.99 for r in rewards) / n, 3)
        out["mcp"] = self.env.stats()
        print(json.dumps(out), flush=True)

    async def groups(self, tasks: list[dict]) -> list:
        res = await asyncio.gather(*(self.rollout.arun_episode(self.engine, t) for t in tasks))
        for g, rows in enumerate(res):  # one advantage group per task (the worker names them so)
            for s in rows:
                s.group_id = f"g{g}"
        return [s for rows in res for s in rows]

    async def run(self, train: list[dict], held: list[dict]) -> None:
        """Evaluation before RL, then --steps steps of B groups, evaluated every --eval-every steps and at the end."""
        from areal_core.rollout.admission import prompt_order
        from areal_core.train.step import train_step

        a, model = self.a, self.model
        await self.evaluate(0, held)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.99))
        for step in range(1, a.steps + 1):
            rows = await self.groups([train[i] for i in prompt_order(len(train), step)[: a.b]])
            if rows:
                model.train()
                m = train_step(model, opt, rows, self.cfg, self.tok.pad_token_id)
                model.eval()
                self.out["reward_mean"].append(round(m["reward_mean"], 3))
            self.engine.version += 1
            if step % a.eval_every == 0 or step == a.steps:
                await self.evaluate(step, held)
        await self.env.aclose()

    def close(self) -> None:
        self.rollout.close()
        self.greedy.close()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    from areal_core.models import build_tiny_model, build_tokenizer
    from examples.search_agent.agent import search_corpus
    from examples.search_agent.kb import KnowledgeBase, questions

    kb = KnowledgeBase.build(a.seed, a.people)
    train, held = questions(kb, a.num_train, a.eval_n, seed=a.seed, kinds=tuple(a.kinds.split(",")))
    cfg = probe_config(a)
    tok = build_tokenizer(search_corpus(train), cfg.model.vocab_size)
    model = build_tiny_model(cfg.model, len(tok), a.seed)
    out: dict = {"args": vars(a), "success": {}, "exact": {}, "cited": {}, "reward_mean": []}
    t0 = time.time()
    warm_start(a, model, tok, train, out)
    probe = SearchProbe(a, cfg, model, tok, out)
    try:
        asyncio.run(probe.run(train, held))
    finally:
        probe.close()
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
