"""Scale: peak memory and step time of the trainer and the rollout engine against vocabulary, answer
length and model shape, random weights (issue 44). Every measurement runs in a fresh process, so
ru_maxrss is its own peak; `added_mb` is what the measured block adds (AddedMemory).

    PYTHONPATH=. .venv/bin/python benchmarks/scale.py table [--code DIR] [--quick] [--out F.json]
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py trainer --shape tiny --vocab 151936 --rows 8 --answer 512
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py rollout --shape tiny --vocab 151936 --rows 8 --answer 512
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py attention --attention segments --prompt 2048 --answer 256

`trainer`: `train_step` (GRPO, decoupled PPO, the shipped defaults) on one group of `--rows`
answers of `--answer` tokens under a `--prompt`-token prompt, rewards varying; `--steps` steps,
the last one timed. `rollout`: the continuous engine generating `--rows` answers of exactly
`--answer` tokens; with `--swap-at K` a new version is staged at step K and the re-prefill counted
(`--budget`: rollout.reprefill_budget_tokens). `attention`: one log-prob pass with its backward
over a group sharing a long prompt, per span or under masks. `table` runs the grid below and
prints a markdown table; `--code DIR` runs it against another checkout (the code before issue 44:
`git worktree add /tmp/before 5048631~1`), setting only the config keys that checkout has.
`--device cuda` runs the trainer case on a GPU (tokens/s and MFU, bf16 autocast; with `--compile`,
torch.compile on the model); benchmarks/gpu_smoke.py calls it so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.memory import AddedMemory

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # Qwen2 transformer shapes (hidden, layers, heads, kv heads, intermediate)
    "tiny": (128, 2, 4, 2, 256),
    "small": (256, 2, 4, 2, 512),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960),
}
REAL_VOCAB = 151936


def _rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def build(shape: str, vocab: int, max_len: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter = SHAPES[shape]
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        tie_word_embeddings=True,
        max_position_embeddings=max(max_len, 128),
        pad_token_id=0,
        eos_token_id=1,
    )
    return Qwen2ForCausalLM(cfg).float()


def samples(vocab: int, rows: int, prompt: int, answer: int, groups: int = 1, seed: int = 0):
    import random

    from areal_core.protocol import Sample

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p = [rng.randrange(2, vocab) for _ in range(prompt)]
        for k in range(rows):
            r = [rng.randrange(2, vocab) for _ in range(answer)]
            out.append(
                Sample(
                    sample_id=f"{g}-{k}",
                    group_id=str(g),
                    prompt_id=str(g),
                    worker_id="w",
                    input_ids=p + r,
                    prompt_len=prompt,
                    loss_mask=[0] * prompt + [1] * answer,
                    behav_logprobs=[0.0] * prompt + [-11.9 + rng.uniform(-0.1, 0.1) for _ in range(answer)],
                    versions=[-1] * prompt + [0] * answer,
                    reward=float(k % 2),
                )
            )
    return out


def trainer(a: argparse.Namespace) -> dict:
    import torch

    from areal_core.config import RunConfig, load_config
    from areal_core.train.step import train_step

    torch.set_num_threads(a.threads or torch.get_num_threads())
    dev = torch.device(a.device)
    model = build(a.shape, a.vocab, a.prompt + a.answer + 8).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    wanted = {"train.lr": 1e-5, "train.batch_groups": a.groups, "rollout.group_size": a.rows}
    wanted.update(dict(kv.split("=", 1) for kv in a.set))
    have = RunConfig.model_fields["train"].annotation.model_fields  # an older checkout lacks some keys
    cfg = load_config(None, [f"{k}={v}" for k, v in wanted.items() if not k.startswith("train.") or k[6:] in have])
    if a.lora:
        from areal_core.train.lora import apply_lora

        model = apply_lora(model, r=a.lora, alpha=2 * a.lora)
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch = samples(a.vocab, a.rows, a.prompt, a.answer, a.groups)
    seconds = []
    added = AddedMemory().__enter__()
    for _ in range(a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            train_step(model, opt, batch, cfg, 0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    tokens = len(batch) * (a.prompt + a.answer)
    out = {"shape": a.shape, "vocab": a.vocab, "params_m": round(n_params / 1e6, 1), "tokens": tokens}
    out["step_s"] = round(seconds[-1], 2)
    added.__exit__()
    out.update(peak_mb=_rss_mb(), added_mb=added.added_mb, tokens_per_s=round(tokens / seconds[-1]))
    if dev.type == "cuda":
        out["gpu_peak_mb"] = torch.cuda.max_memory_allocated() // 2**20
        out["mfu"] = round(6 * n_params * tokens / seconds[-1] / (a.peak_tflops * 1e12), 4)
    return out


def rollout(a: argparse.Namespace) -> dict:
    import torch

    from areal_core.rollout.continuous_engine import ContinuousEngine
    from areal_core.rollout.engine import SamplingParams

    torch.set_num_threads(a.threads or torch.get_num_threads())
    model = build(a.shape, a.vocab, a.prompt + a.answer + 8)
    eng = ContinuousEngine(model, 0, -1, slots=a.rows, reprefill_budget=a.budget)  # eos -1: every answer runs out
    if a.swap_at:
        staged = {k: v.clone() for k, v in model.state_dict().items()}
        original, calls = eng._step, [0]

        def step(*args):
            calls[0] += 1
            if calls[0] == a.swap_at:
                eng.stage_weights(1, staged)
            return original(*args)

        eng._step = step
    prompts = [list(range(2, 2 + a.prompt))] * a.rows
    t0 = time.perf_counter()
    with AddedMemory() as added:
        gens = eng.generate(prompts, SamplingParams(max_new_tokens=a.answer, temperature=1.0, seed=0))
    seconds = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "reprefill_tokens": eng.stats["reprefill_tokens"],
        "swaps": eng.swaps,
        "deferred_swap_steps": eng.deferred_swap_steps,
        "peak_mb": _rss_mb(),
        "added_mb": added.added_mb,
    }


def attention(a: argparse.Namespace) -> dict:
    import torch

    from areal_core.train.packing import packed_token_logprobs

    torch.set_num_threads(a.threads or torch.get_num_threads())
    model = build(a.shape, a.vocab, a.prompt + a.answer + 8).train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, a.vocab, (a.prompt,), generator=g)
    ids = torch.cat([prompt.expand(a.rows, -1), torch.randint(2, a.vocab, (a.rows, a.answer), generator=g)], 1)
    group = torch.zeros(a.rows, dtype=torch.long)
    t0 = time.perf_counter()
    with AddedMemory() as added:
        mask = torch.ones_like(ids)
        lp = packed_token_logprobs(model, ids, mask, group_index=group, attention=a.attention, logit_chunk=512)
        lp.sum().backward()
    return {"tokens": ids.numel(), "seconds": round(time.perf_counter() - t0, 2), "added_mb": added.added_mb}


# (kind, label, args): the table's grid; --quick keeps the rows marked True
GRID = [
    ("trainer", "vocab 384", "--vocab 384 --rows 8 --answer 512", True),
    ("trainer", "vocab 32,768", "--vocab 32768 --rows 8 --answer 512", False),
    ("trainer", "vocab 151,936", "--vocab 151936 --rows 8 --answer 512", True),
    ("trainer", "answer 24", "--vocab 151936 --rows 8 --answer 24", False),
    ("trainer", "answer 2,048", "--vocab 151936 --rows 8 --answer 2048", False),
    ("trainer", "answer 4,096", "--vocab 151936 --rows 4 --answer 4096", True),
    ("trainer", "8 groups × 8, answer 512", "--vocab 151936 --rows 8 --groups 8 --answer 512", True),
    ("trainer", "Qwen2.5-0.5B", "--shape qwen2.5-0.5b --vocab 151936 --rows 4 --answer 256 --steps 1", False),
    (
        "trainer",
        "Qwen2.5-1.5B, LoRA 16",
        "--shape qwen2.5-1.5b --vocab 151936 --rows 2 --answer 256 --steps 1 --lora 16",
        False,
    ),
    ("rollout", "vocab 384", "--vocab 384 --rows 8 --answer 512", True),
    ("rollout", "vocab 151,936", "--vocab 151936 --rows 8 --answer 512", True),
    ("rollout", "answer 4,096", "--vocab 151936 --rows 8 --answer 4096", False),
    ("rollout", "4,096, swap at step 2,048", "--vocab 151936 --rows 8 --answer 4096 --swap-at 2048", False),
    ("rollout", "the same, budget 8,192", "--vocab 151936 --rows 8 --answer 4096 --swap-at 2048 --budget 8192", False),
]


def table(a: argparse.Namespace) -> dict:
    code = Path(a.code).resolve() if a.code else ROOT
    env = {**os.environ, "PYTHONPATH": str(code)}
    results = []
    for kind, label, args, quick in GRID:
        if (a.quick and not quick) or (a.kinds and kind not in a.kinds):
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), kind, *args.split()]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=a.timeout)
        row = {"kind": kind, "case": label, "wall_s": round(time.perf_counter() - t0, 1)}
        if out.returncode == 0:
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        else:
            row["error"] = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
        results.append(row)
        print(json.dumps(row), flush=True)
    print("| role | case | peak RSS MB | added MB | step or call s | tokens/s | re-prefilled |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        secs = r.get("step_s", r.get("seconds", ""))
        print(
            f"| {r['kind']} | {r['case']} | {r.get('peak_mb', r.get('error', ''))} | {r.get('added_mb', '')} | "
            f"{secs} | {r.get('tokens_per_s', '')} | {r.get('reprefill_tokens', '')} |"
        )
    return {"code": str(code), "rows": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["trainer", "rollout", "attention", "table"])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--vocab", type=int, default=REAL_VOCAB)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--answer", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lora", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides key=value (trainer)")
    ap.add_argument("--swap-at", type=int, default=0)
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--code", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kinds", nargs="*", default=[], help="table: only these kinds (trainer, rollout)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    result = {"trainer": trainer, "rollout": rollout, "attention": attention, "table": table}[a.what](a)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    if a.what != "table":
        print(json.dumps(result))


if __name__ == "__main__":
    main()
