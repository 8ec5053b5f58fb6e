"""The default job's rollout call on the continuous engine, by CPU time: 8 prompts × 8 samples, 25-token prompts,
24 new tokens, temperature 0.7, one torch thread (the rollout role's shape). Run it under two trees' PYTHONPATH,
interleaved, to compare engine code (docs/benchmarks.md, "The default job before and after this round").

    PYTHONPATH=. .venv/bin/python benchmarks/rollout_call.py --init runs/idle-quiet/sft/init_model [--calls 30]

Prints {"best_ms", "mean_ms"} of `--calls` calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from areal_core.models import load_pretrained
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", required=True, help="an HF checkpoint folder (the job's SFT init_model)")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_pretrained(args.init)
    model.eval()
    engine = ContinuousEngine(model, tok.pad_token_id, tok.eos_token_id, slots=64, tokenizer=tok)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (25,), generator=gen).tolist() for _ in range(8)]
    batch = [p for p in prompts for _ in range(8)]
    params = [SamplingParams(max_new_tokens=24, temperature=0.7, seed=i) for i in range(len(batch))]
    engine.generate(batch, params)
    times = []
    for _ in range(args.calls):
        t0 = time.process_time()
        engine.generate(batch, params)
        times.append(time.process_time() - t0)
    print(json.dumps({"best_ms": round(min(times) * 1e3, 2), "mean_ms": round(sum(times) / len(times) * 1e3, 2)}))


if __name__ == "__main__":
    main()
