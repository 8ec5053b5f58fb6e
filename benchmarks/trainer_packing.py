"""Trainer throughput, packed vs padded: forward + backward of token log-probs on a long-tail batch.

    PYTHONPATH=. python benchmarks/trainer_packing.py --threads 2 --out /tmp/packing.json

Each variant computes logp[N, T] with gradient and back-propagates Σ logp·mask, the shape of a
PPO step. Throughput counts real (non-pad) tokens. Variants:
  padded                  one right-padded [N, T_max] forward (today's trainer)
  packed rows=max_len     packed into rows of the longest sequence, one forward
  packed budget=B         micro-batches of ≤ B tokens, each packed into rows of the longest
                          sequence in it (gradient accumulation; lower peak memory)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model
from areal_core.train.logprobs import token_logprobs
from areal_core.train.packing import micro_batches_by_tokens, packed_token_logprobs


def long_tail_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal lengths clipped to [lo, hi]: most short, a few near `hi`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) * 0.9 + torch.log(torch.tensor(hi / 6.0)))
    lengths = x.clamp(lo, hi).round().long().tolist()
    lengths[0] = hi  # the tail: one sequence at the limit fixes the padded width
    return lengths


def make_batch(lengths: list[int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    attn = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    return ids * attn, attn


def step(model, ids, attn, variant: str, budget: int) -> None:
    model.zero_grad(set_to_none=True)
    mask = attn.float()
    if variant == "padded":
        (token_logprobs(model, ids, attn) * mask).sum().backward()
    elif variant == "packed":
        (packed_token_logprobs(model, ids, attn) * mask).sum().backward()
    elif variant == "packed_budget":
        for rows in micro_batches_by_tokens(attn.sum(1), budget):
            r = torch.tensor(rows)
            (packed_token_logprobs(model, ids[r], attn[r]) * mask[r]).sum().backward()
    else:
        raise ValueError(variant)


def bench(model, ids, attn, variants: list[str], budget: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step for each variant; variants interleaved so that load spikes on a shared
    machine hit all of them alike."""
    for v in variants:  # warm-up
        step(model, ids, attn, v, budget)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            t0 = time.perf_counter()
            step(model, ids, attn, v, budget)
            times[v].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=384)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=max(args.max_len, 256),
    )
    model = build_tiny_model(cfg, args.vocab, seed=0)
    model.set_attn_implementation(args.attn)
    model.train()
    lengths = long_tail_lengths(args.seqs, args.min_len, args.max_len, seed=0)
    ids, attn = make_batch(lengths, args.vocab, seed=1)
    real = sum(lengths)
    variants = ["padded", "packed", "packed_budget"]
    times = bench(model, ids, attn, variants, args.budget, args.repeats)
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        rows.append({"variant": v, "seconds": med, "seconds_min": min(times[v]), "tokens_per_s": real / med})
    base = rows[0]["tokens_per_s"]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads",
        "model": f"Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab} attn={args.attn}",
        "batch": f"{args.seqs} seqs, lengths {min(lengths)}..{max(lengths)} (mean {real / len(lengths):.0f}), "
        f"{real} real tokens, padded {ids.numel()} ({1 - real / ids.numel():.0%} padding)",
        "budget": args.budget,
        "repeats": args.repeats,
        "load_average_1m": os.getloadavg()[0],
        "rows": rows,
    }
    print(result["machine"], "|", result["model"], "|", result["batch"], "| load", result["load_average_1m"])
    print("| variant | s / step (median) | s / step (min) | real tokens/s | vs padded |\n|---|---|---|---|---|")
    for r in rows:
        name = r["variant"] if r["variant"] != "packed_budget" else f"packed, budget {args.budget}"
        print(
            f"| {name} | {r['seconds']:.3f} | {r['seconds_min']:.3f} | {r['tokens_per_s']:.0f} "
            f"| {r['tokens_per_s'] / base:.2f}× |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
