"""Peak memory and time of one trainer log-prob pass with its backward, full logits against the LM
head in chunks (train/head.py, `train.logit_chunk_tokens`), at a real vocabulary (issue 44).

    PYTHONPATH=. .venv/bin/python benchmarks/logit_memory.py [--vocab 151936] [--rows 8] [--tokens 512] \\
        [--chunks 0 512 2048]

Each setting runs in a fresh process (so ru_maxrss is its own peak): a tiny Qwen2 (hidden 64, 1
layer, tied embeddings) with `--vocab` rows, `--rows` sequences of `--tokens` tokens in one group
(the tree-packed path the trainer takes), log-probs with gradients, a backward, and the peak RSS
and seconds printed as one JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from benchmarks.memory import AddedMemory


def one(vocab: int, rows: int, tokens: int, chunk: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_core.train.packing import packed_token_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=max(tokens, 64),
    )
    model = Qwen2ForCausalLM(cfg).float()
    ids = torch.randint(0, vocab, (rows, tokens))
    ids[:, :16] = ids[0, :16]  # one group: a shared 16-token prompt
    mask = torch.ones_like(ids)
    t0 = time.perf_counter()
    with AddedMemory() as added:
        lp = packed_token_logprobs(model, ids, mask, group_index=torch.zeros(rows, dtype=torch.long), logit_chunk=chunk)
        lp.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "vocab": vocab,
        "tokens": rows * tokens,
        "chunk": chunk,
        "peak_mb": round(peak / 1024),
        "added_mb": added.added_mb,
        "seconds": round(seconds, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 2048])
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.vocab, args.rows, args.tokens, args.chunks[0])))
        return
    for chunk in args.chunks:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            "--vocab",
            str(args.vocab),
            "--rows",
            str(args.rows),
            "--tokens",
            str(args.tokens),
            "--chunks",
            str(chunk),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        print(
            out.stdout.strip()
            or f'{{"chunk": {chunk}, "failed": {out.returncode}, "err": {json.dumps(out.stderr[-300:])}}}'
        )


if __name__ == "__main__":
    main()
