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

import torch


def main() -> None:
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
    a = ap.parse_args()
    torch.set_num_threads(1)
    from areal_core.config import load_config
    from areal_core.evaluate import agent_success
    from areal_core.models import build_tiny_model, build_tokenizer
    from areal_core.proxy.agent_workflow import AgentWorkflow
    from areal_core.proxy.examples import calculator_corpus, calculator_sft_examples, sft_calculator
    from areal_core.rollout.admission import prompt_order
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.train.sft import sft_examples
    from areal_core.train.step import train_step
    from task_data.arithmetic import generate

    agent = "areal_core.proxy.examples:calculator_agent"
    train, held = generate(a.seed, 400, a.eval_n, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 400)
    cfg = load_config(
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
    model = build_tiny_model(cfg.model, len(tok), a.seed)
    rng = random.Random(5)
    examples = []
    for r in train:  # the same mix as areal_core.train.sft.agent_sft_examples
        if rng.random() < a.mix:
            examples += calculator_sft_examples(tok, [r])
        else:
            ids, plen = sft_examples(tok, [r])[0]
            examples.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    import areal_core.proxy.examples as ex

    ex.calculator_sft_examples = lambda _tok, _records: examples  # sft_calculator trains on these
    t0 = time.time()
    sft_calculator(model, tok, train, steps=a.sft, lr=3e-3, batch_size=32, seed=a.seed)
    out = {"args": vars(a), "sft_s": round(time.time() - t0, 1), "success": {}, "reward_mean": []}
    out["success"][0] = agent_success(model, tok, agent, held, a.max_new_tokens)
    print(json.dumps(out), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.99))
    engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, seed=7)
    workflow = AgentWorkflow(
        tok,
        agent,
        group_size=a.g,
        sampling=SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature),
    )

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
                out["success"][step] = agent_success(model, tok, agent, held, a.max_new_tokens)
                print(json.dumps(out), flush=True)
    finally:
        workflow.close()
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
