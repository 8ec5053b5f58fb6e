"""A fast in-process probe of calculator-agent RL (no role processes): tiny model, warm start
mixing agent episodes (share `--mix`) with plain answers, then synchronous GRPO steps where each
step runs B groups of G agent episodes through an in-process proxy and takes one decoupled-PPO
update; prints held-out greedy agent success before and every `--eval-every` steps.

    PYTHONPATH=. .venv/bin/python benchmarks/agent_rl_probe.py --sft 150 --mix 0.3 --lr 2e-4 --steps 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import torch

AGENT = "areal_core.proxy.examples:calculator_agent"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for name, typ, default in [
        ("sft", int, 150),
        ("mix", float, 0.3),
        ("lr", float, 2e-4),
        ("steps", int, 10),
        ("b", int, 4),
        ("g", int, 8),
        ("hidden", int, 64),
        ("layers", int, 2),
        ("eval_n", int, 40),
        ("eval_every", int, 5),
        ("max_new_tokens", int, 40),
        ("temperature", float, 1.0),
        ("seed", int, 1),
    ]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=typ, default=default)
    return ap.parse_args()


def probe_config(a: argparse.Namespace) -> Any:
    """The run config of the probe: the tiny model's shape, lr, η = 0, B groups of G."""
    from areal_core.config import load_config

    return load_config(
        None,
        [
            f"model.hidden_size={a.hidden}",
            f"model.num_layers={a.layers}",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            f"model.intermediate_size={2 * a.hidden}",
            f"train.lr={a.lr}",
            "train.eta=0",
            f"rollout.group_size={a.g}",
            f"train.batch_groups={a.b}",
            f"rollout.temperature={a.temperature}",
        ],
    )


def warm_start(a: argparse.Namespace, model: Any, tok: Any, train: list[dict]) -> None:
    """SFT of `model` on agent episodes (share --mix) mixed with plain answers, as
    areal_core.train.sft.agent_sft_examples mixes them."""
    import areal_core.proxy.examples as ex
    from areal_core.proxy.examples import calculator_sft_examples, sft_calculator
    from areal_core.train.sft import sft_examples

    rng = random.Random(5)
    examples = []
    for r in train:  # the same mix as areal_core.train.sft.agent_sft_examples
        if rng.random() < a.mix:
            examples += calculator_sft_examples(tok, [r])
        else:
            ids, plen = sft_examples(tok, [r])[0]
            examples.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    ex.calculator_sft_examples = lambda _tok, _records: examples  # sft_calculator trains on these
    sft_calculator(model, tok, train, steps=a.sft, lr=3e-3, batch_size=32, seed=a.seed)


def rl_steps(
    a: argparse.Namespace, model: Any, tok: Any, cfg: Any, train: list[dict], held: list[dict], out: dict
) -> None:
    """--steps synchronous GRPO steps of B agent groups each; the mean reward of each step and
    held-out success every --eval-every steps go into `out` (printed at each evaluation)."""
    from areal_core.evaluate import agent_success
    from areal_core.proxy.agent_workflow import AgentWorkflow
    from areal_core.rollout.admission import prompt_order
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.train.step import train_step

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.99))
    engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, seed=7)
    sampling = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    workflow = AgentWorkflow(tok, AGENT, group_size=a.g, sampling=sampling)

    async def groups(tasks: list[dict]) -> list:
        out = await asyncio.gather(*(workflow.arun_episode(engine, t) for t in tasks))
        for g, rows in enumerate(out):  # one advantage group per task (the worker names them so)
            for s in rows:
                s.group_id = f"g{g}"
        return [s for rows in out for s in rows]

    try:
        for step in range(1, a.steps + 1):
            rows = asyncio.run(groups([train[i] for i in prompt_order(len(train), step)[: a.b]]))
            model.train()
            m = train_step(model, opt, rows, cfg, tok.pad_token_id)
            model.eval()
            engine.version += 1
            out["reward_mean"].append(round(m["reward_mean"], 3))
            if step % a.eval_every == 0 or step == a.steps:
                out["success"][step] = agent_success(model, tok, AGENT, held, a.max_new_tokens)
                print(json.dumps(out), flush=True)
    finally:
        workflow.close()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    from areal_core.evaluate import agent_success
    from areal_core.models import build_tiny_model, build_tokenizer
    from areal_core.proxy.examples import calculator_corpus
    from task_data.arithmetic import generate

    train, held = generate(a.seed, 400, a.eval_n, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 400)
    cfg = probe_config(a)
    model = build_tiny_model(cfg.model, len(tok), a.seed)
    t0 = time.time()
    warm_start(a, model, tok, train)
    out = {"args": vars(a), "sft_s": round(time.time() - t0, 1), "success": {}, "reward_mean": []}
    out["success"][0] = agent_success(model, tok, AGENT, held, a.max_new_tokens)
    print(json.dumps(out), flush=True)
    rl_steps(a, model, tok, cfg, train, held, out)
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
