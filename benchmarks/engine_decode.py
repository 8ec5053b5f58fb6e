"""Decode throughput of the built-in engines vs `transformers` `generate`, and continuous vs
static batching on long-tailed lengths, on the tiny default model (configs/default.yaml sizes)
or a tiny Qwen3-MoE of the same attention and active MLP width (`--model qwen3_moe`: 16 experts,
top-4, expert width 96, norm_topk_prob, as Qwen3-30B-A3B's 128 / top-8 scaled down) or a tiny
DeepSeek-V3 of the same widths (`--model deepseek_v3`: MLA, a dense first layer, group-limited routing)
or a tiny gpt-oss of the same widths (`--model gpt_oss`: attention sinks, windows of 16 on alternate layers).

    PYTHONPATH=. .venv/bin/python benchmarks/engine_decode.py --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/engine_decode.py --threads 2 --skip-longtail
    PYTHONPATH=. .venv/bin/python benchmarks/engine_decode.py --model qwen3_moe --batch 32 --slots 32
    PYTHONPATH=. .venv/bin/python benchmarks/engine_decode.py --model deepseek_v3 --batch 32 --slots 32
    PYTHONPATH=. .venv/bin/python benchmarks/engine_decode.py --model gpt_oss --batch 32 --slots 32

Equal lengths: batch B prompts of P random tokens, exactly N new tokens each (no token ends a
sequence), sampling at temperature 1 (top-k/top-p off); tokens/s = B·N / time of the whole call
(prefill included), best of `--repeats`, by wall clock and by process CPU time (the steadier
number when other jobs share the cores; with one thread it is the compute time). Long tail: R requests with
max_new_tokens drawn
from a clipped Pareto law; useful tokens/s = Σ lengths / wall time. The static baselines run
batches of `slots` requests to the batch's longest length (what a static batch does).
Floor (`--floor`): the continuous engine's own GEMMs and decode attention timed alone in a hot
loop at the benchmark's batch and mid-run span, the least a decode step of this model can cost
in float32 on this machine, against one third of `generate`'s measured step (the 3× goal).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.static_cache import StaticCacheDecoder
from areal_core.rollout.torch_engine import TorchEngine

NO_EOS = -1  # an id no sampler returns: every sequence runs to its length


def cpu_name() -> str:
    """The CPU's model name as lscpu prints it (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical CPUs)"
    except (OSError, IndexError):
        return platform.processor() or platform.machine()


def timed(fn, repeats: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) over `repeats` calls. On a shared machine the
    CPU time is the steadier measure: it excludes the time other jobs held the cores."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def hf_generate(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.shape[1] == prompts.shape[1] + new
    return out


def equal_lengths(model, batch: int, plen: int, new: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, plen), generator=g)
    plist = prompts.tolist()
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=1)
    cont = ContinuousEngine(model, 0, NO_EOS, slots=batch)
    static = TorchEngine(model, 0, NO_EOS)

    def run_cont():
        gens = cont.generate(plist, params)
        assert all(len(x.token_ids) == new for x in gens)

    def run_static():
        gens = static.generate(plist, params)
        assert all(len(x.token_ids) == new for x in gens)

    run_cont()  # warm-up: allocates the cache
    res = {}
    for name, fn in [
        ("transformers_generate", lambda: hf_generate(model, prompts, new)),
        ("torch_engine", run_static),
        ("continuous_engine", run_cont),
    ]:
        wall, cpu = timed(fn, repeats)
        res[name] = {"tok_s_wall": round(batch * new / wall, 1), "tok_s_cpu": round(batch * new / cpu, 1)}
    for eng in ("continuous_engine", "torch_engine"):
        for k in ("tok_s_wall", "tok_s_cpu"):
            res[f"speedup_{eng}_vs_generate_{k[6:]}"] = round(res[eng][k] / res["transformers_generate"][k], 2)
    for k in ("tok_s_wall", "tok_s_cpu"):
        res[f"speedup_continuous_vs_torch_engine_{k[6:]}"] = round(
            res["continuous_engine"][k] / res["torch_engine"][k], 2
        )
    return res


def hot_ms(fn, n: int = 300) -> float:
    """Mean milliseconds of fn() over n back-to-back calls after a warm-up (operands stay in cache)."""
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def gemm_and_attention_ms(dec: StaticCacheDecoder, batch: int, span: int, dtype: torch.dtype) -> dict:
    """Hot-loop milliseconds of one decode step's GEMMs and of its attention, each alone, with
    operands of `dtype` (the decoder's weights cast; the attention's K/V in the decoder's layout)."""
    H, KVH, D = dec.n_heads, dec.n_kv, dec.head_dim
    mats = [w.to(dtype) for L in dec.layers for w in (L.w_qkv, L.w_o, L.w_gate_up, L.w_down)] + [dec.lm_head.to(dtype)]
    xs = {k: torch.randn(batch, k, dtype=dtype) for k in {w.shape[1] for w in mats}}
    gemm = sum(hot_ms(lambda w=w: torch.nn.functional.linear(xs[w.shape[1]], w)) for w in mats)
    cache = torch.randn(dec.kv[0].shape, dtype=dtype)
    q = torch.randn(batch * KVH, H // KVH, D, dtype=dtype)
    bias = torch.zeros(batch * KVH, 1, span, dtype=dtype)

    def attention():  # the decode path's three ops (static_cache.StaticCacheDecoder.decode)
        keys = cache[0, :, :, :span].reshape(batch * KVH, span, D)
        vals = cache[1, :, :, :span].reshape(batch * KVH, span, D)
        s = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=dec.scale)
        return torch.bmm(torch.softmax(s, dim=-1), vals)

    attn = hot_ms(attention) * len(dec.layers)
    flops = sum(2 * batch * w.numel() for w in mats)
    return {
        "gemm_ms": round(gemm, 3),
        "gemm_gflops": round(flops / gemm / 1e6, 1),
        "attention_ms": round(attn, 3),
        "floor_ms": round(gemm + attn, 3),
    }


@torch.inference_mode()
def floor(model, batch: int, span: int, generate_tok_s: float) -> dict:
    """The float32 floor of a decode step at `span` keys, our whole forward pass alone in a hot
    loop, the same floor with bfloat16 and float16 operands, and the step the 3× goal needs."""
    dec = StaticCacheDecoder(model, batch, span + 1)
    ids = torch.randint(3, model.config.vocab_size, (batch,))
    step = hot_ms(lambda: dec.decode(ids, torch.full((batch,), span - 1), span), n=100)
    gen_step = batch / generate_tok_s * 1e3
    return {
        "span": span,
        **gemm_and_attention_ms(dec, batch, span, torch.float32),
        "decode_forward_ms_hot": round(step, 3),
        "generate_step_ms": round(gen_step, 3),
        "step_ms_for_3x": round(gen_step / 3, 3),
        "bfloat16": gemm_and_attention_ms(dec, batch, span, torch.bfloat16),
        "float16": gemm_and_attention_ms(dec, batch, span, torch.float16),
    }


def long_tail(model, requests: int, slots: int, plen: int, cap: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.minimum(cap, (8 * (1 + rng.pareto(1.2, requests))).astype(int)).tolist()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (requests, plen), generator=g).tolist()
    plist = [SamplingParams(max_new_tokens=n, seed=i) for i, n in enumerate(lengths)]
    useful = sum(lengths)
    res = {"requests": requests, "slots": slots, "mean_len": round(float(np.mean(lengths)), 1), "max_len": max(lengths)}
    for policy in ("continuous", "static"):
        eng = ContinuousEngine(model, 0, NO_EOS, slots=slots, policy=policy, max_seq_len=plen + cap + 1)

        def run(eng=eng):
            gens = eng.generate(prompts, plist)
            assert [len(x.token_ids) for x in gens] == lengths

        run()
        steps0 = eng.stats["steps"]
        run()
        res[f"{policy}_steps"] = eng.stats["steps"] - steps0
        wall, cpu = timed(run, repeats)
        res[f"{policy}_tok_s_wall"], res[f"{policy}_tok_s_cpu"] = round(useful / wall, 1), round(useful / cpu, 1)
    torch_eng = TorchEngine(model, 0, NO_EOS)

    def run_torch():
        for i in range(0, requests, slots):
            batch_len = max(lengths[i : i + slots])
            torch_eng.generate(prompts[i : i + slots], SamplingParams(max_new_tokens=batch_len))

    wall, cpu = timed(run_torch, repeats)
    res["torch_engine_static_tok_s_wall"], res["torch_engine_static_tok_s_cpu"] = (
        round(useful / wall, 1),
        round(useful / cpu, 1),
    )
    for k in ("wall", "cpu"):
        res[f"continuous_vs_static_same_kernels_{k}"] = round(
            res[f"continuous_tok_s_{k}"] / res[f"static_tok_s_{k}"], 2
        )
        res[f"continuous_vs_torch_engine_{k}"] = round(
            res[f"continuous_tok_s_{k}"] / res[f"torch_engine_static_tok_s_{k}"], 2
        )
    return res


MODELS = {
    "qwen2": "tiny Qwen2 (hidden 128, 4 layers, 4 heads / 2 kv, vocab 384), float32",
    "qwen3_moe": "tiny Qwen3-MoE (hidden 128, 4 layers, 4 heads / 2 kv, head_dim 32, 16 experts, top-4, "
    "expert width 96, norm_topk_prob, vocab 384), float32",
    "deepseek_v3": "tiny DeepSeek-V3 (hidden 128, 4 layers, the first dense, 4 heads of MLA: q rank 64, kv rank 32, "
    "nope 32 + rope 16, v 32; 16 experts in 4 groups (2 kept), top-4, expert width 96, 1 shared, vocab 384), float32",
    "gpt_oss": "tiny gpt-oss (hidden 128, 4 layers alternating a 16-token window and full attention, 4 heads / 2 kv, "
    "head_dim 32, sinks, 16 experts, top-4, expert width 96, vocab 384), float32",
}


SHARED = dict(vocab_size=384, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=512)
MOE_CONFIGS = {  # the transformers classes and the settings beyond SHARED of the tiny MoEs (MODELS)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96)
        | dict(norm_topk_prob=True, tie_word_embeddings=True),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(intermediate_size=384, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32)
        | dict(qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_group=4, topk_group=2)
        | dict(num_experts_per_tok=4, moe_intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_key_value_heads=2, head_dim=32, num_local_experts=16, num_experts_per_tok=4, intermediate_size=96)
        | dict(sliding_window=16),
    ),
}


def build_model(name: str) -> torch.nn.Module:
    """The benchmark's model `name` (MODELS), randomly initialised (seed 0), float32, in eval mode."""
    if name == "qwen2":
        return build_tiny_model(ModelConfig(), 384, 0).eval()
    import transformers

    config_class, model_class, settings = MOE_CONFIGS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**SHARED, **settings)
    return getattr(transformers, model_class)(cfg).float().eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32, help="long tail: slots (static batch size)")
    ap.add_argument("--skip-longtail", action="store_true")
    ap.add_argument("--floor", action="store_true", help="also time the GEMM + attention floor of a decode step")
    args = ap.parse_args()
    if args.floor and args.model != "qwen2":
        ap.error("--floor times the dense model's GEMMs: use it with --model qwen2")
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    out = {
        "machine": f"{cpu_name()}, torch {torch.__version__}, threads {args.threads}",
        "model": MODELS[args.model],
        "equal_lengths": [
            {
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "new_tokens": new,
                **equal_lengths(model, args.batch, args.prompt_len, new, args.repeats),
            }
            for new in args.new_tokens
        ],
    }
    if args.floor:
        last = out["equal_lengths"][-1]
        span = args.prompt_len + last["new_tokens"] // 2
        out["floor"] = floor(model, args.batch, span, last["transformers_generate"]["tok_s_wall"])
    if not args.skip_longtail:
        print(json.dumps(out, indent=2), flush=True)  # the equal-length results while the long tail runs
        out["long_tail"] = long_tail(model, args.requests, args.slots, args.prompt_len, 224, args.repeats)
        print("--- with the long tail:")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
