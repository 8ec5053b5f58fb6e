"""Held-out greedy accuracy split by the number of worked steps of each problem.

python benchmarks/accuracy_by_steps.py RUN_ROOT [init_model final_model ...]
"""

from __future__ import annotations

import collections
import sys

import torch

from areal_core.models import chat_prompt, load_pretrained
from areal_core.prompts import load_prompts
from areal_core.reward.math import gsm8k_reward
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store


def main() -> None:
    torch.set_num_threads(1)
    store = Store(sys.argv[1])
    records = load_prompts(store, "eval")[:500]
    for name in sys.argv[2:] or ["init_model", "final_model"]:
        model, tok = load_pretrained(store.url(name), "cpu")
        model.eval()
        engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id)
        by_steps: dict[int, list[float]] = collections.defaultdict(list)
        for start in range(0, len(records), 128):
            chunk = records[start : start + 128]
            prompts = [chat_prompt(tok, r["prompt"]) for r in chunk]
            for r, g in zip(chunk, engine.generate(prompts, SamplingParams(max_new_tokens=24, greedy=True))):
                completion = tok.decode(g.token_ids, skip_special_tokens=True)
                by_steps[r["meta"]["steps"]].append(gsm8k_reward(completion, r["answer"]))
        split = {k: f"{sum(v) / len(v):.3f} of {len(v)}" for k, v in sorted(by_steps.items())}
        print(name, "accuracy by steps:", split)


if __name__ == "__main__":
    main()
