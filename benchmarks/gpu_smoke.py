"""The GPU smoke run: one prepared script for the minutes a GPU is lent (issue 25).

    python benchmarks/gpu_smoke.py [--device cuda] [--out gpu_smoke.json]      # on the GPU machine
    python benchmarks/gpu_smoke.py --device cpu --tiny --out /tmp/smoke.json   # the CPU fallback (tests)

Needs nothing from outside the machine: the model is built there (the default job's tiny Qwen2
scaled to ~100M parameters; `--tiny`: the default job's own size) and the data is the embedded
arithmetic task. Sections, each timed and each failing alone (its error is recorded, the
others still run):
  env       torch, CUDA, the device's name and memory;
  trainer   `train_step` on a synthetic batch (bf16 autocast on CUDA, warm-up step included):
            tokens/s and MFU = 6·N·tokens/s / peak FLOP/s (peak from --peak-tflops, default the
            H200's dense bf16 989 TFLOP/s; none on CPU); without --tiny also on Qwen2-0.5B's
            transformer shape with 32 groups (32,768 tokens a step);
  real_vocab  benchmarks/scale.py's trainer case at Qwen2.5's 151,936-row vocabulary and long rows
            (issue 44): Qwen2.5-0.5B's shape with 8 × 1,056-token rows eager and under torch.compile,
            4 × 4,128-token rows, and Qwen2.5-1.5B's shape: tokens/s, MFU, peak GPU memory
            (`--tiny`: the tiny shape, 2 × 288 and 2 × 1,056-token rows on the CPU);
  engines   the built-in engines (torch, continuous) against transformers' generate, tokens/s;
  vllm      vLLM's offline engine on the same model when vllm imports and the device is CUDA,
            else skipped with the reason;
  moe_trainer, moe_engines, megatron_ep  the mixture-of-experts sections (benchmarks/gpu_smoke_moe.py:
            a Qwen3-30B-A3B-like shape at 4 layers, MFU over the active parameters only; expert
            parallel 2 through megatron-core);
  delta_codec  the delta codec's compare and compaction on the device (benchmarks/gpu_smoke_codec.py,
            issue 57): encode and copy + apply GB/s of a 1 GiB bf16 tensor (4% changed) against a
            device copy of it (`--tiny`: 4 MiB);
  rl        the default job for `--rl-steps` RL steps (50; `--tiny`: 3) on the device, through
            the run launcher as `make run` does: wall s/step, the last steps' mean reward.
All figures go to one JSON file (`--out`), printed at the end too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_core.config import ModelConfig, load_config  # noqa: E402
from areal_core.models import build_tiny_model, build_tokenizer, num_params, save_pretrained  # noqa: E402
from areal_core.protocol import Sample  # noqa: E402
from benchmarks import gpu_smoke_codec, gpu_smoke_moe  # noqa: E402

SCALED = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2048}
# Qwen2-0.5B's transformer (its 151k vocabulary aside: the task's tokenizer has ~300 tokens)
QWEN05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864}
TINY = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384}


def section(out: dict, name: str, fn: Callable[[], dict]) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as exc:  # a section that fails is a figure too: which call, on this machine
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    out[name]["section_s"] = round(time.perf_counter() - t0, 2)
    print(f"[gpu_smoke] {name}: {json.dumps(out[name])[:400]}", flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_rates(runs: dict[str, Callable[[], Any]], tokens: int, device: str) -> dict[str, dict]:
    """Each engine's generated tokens/s (`tokens` a call) over a second call after a warm-up; an
    engine that fails is its error, a figure too."""
    out: dict[str, dict] = {}
    for name, fn in runs.items():
        try:
            fn()  # warm-up
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out[name] = {"tok_s": round(tokens / (time.perf_counter() - t0), 1)}
        except Exception as exc:  # noqa: BLE001 - one engine failing is a figure too
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def env(device: str) -> dict:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    info["cuda_available"] = torch.cuda.is_available()
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def model_and_tokenizer(dims: dict, device: str):
    from task_data import load_task

    train, _ = load_task(load_config(None, ["task.num_train=500", "task.num_eval=10"]).task, 0)
    tokenizer = build_tokenizer([r["prompt"] + "\n" + r["answer"] for r in train], 300)
    model = build_tiny_model(ModelConfig(**dims), len(tokenizer), seed=0).to(device)
    return model, tokenizer


def synthetic_batch(vocab: int, groups: int, group_size: int, plen: int, rlen: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(groups):
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        for k in range(group_size):
            resp = torch.randint(3, vocab, (rlen,), generator=g).tolist()
            n = plen + rlen
            out.append(
                Sample(
                    f"s{gi}-{k}",
                    f"g{gi}",
                    f"p{gi}",
                    "w",
                    prompt + resp,
                    plen,
                    [0] * plen + [1] * rlen,
                    [0.0] * plen + [-5.0] * rlen,
                    [-1] * plen + [0] * rlen,
                    reward=float(k % 2),
                )
            )
            assert len(out[-1].input_ids) == n
    return out


def trainer(dims: dict, device: str, steps: int, peak_tflops: float, groups: int = 8) -> dict:
    from areal_core.train.parts import make_optimizer
    from areal_core.train.step import train_step

    cfg = load_config(None, [f"device={device}", "train.batch_groups=8", "rollout.group_size=8"])
    model, tokenizer = model_and_tokenizer(dims, device)
    model.train()
    optimizer = make_optimizer(model, cfg, distributed=False)
    batch = synthetic_batch(model.config.vocab_size, groups, 8, 64, 64)
    tokens = sum(len(s.input_ids) for s in batch)
    for timed in (False, True):  # the warm-up step runs under the same autocast as the timed ones
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps if timed else 1):
            with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
                train_step(model, optimizer, batch, cfg, tokenizer.pad_token_id)
        sync(device)
    seconds = (time.perf_counter() - t0) / steps
    n = num_params(model)
    tok_s = tokens / seconds
    mfu = 6 * n * tok_s / (peak_tflops * 1e12) if device == "cuda" else None
    return {
        "params": n,
        "tokens_per_step": tokens,
        "s_per_step": round(seconds, 4),
        "tokens_per_s": round(tok_s, 1),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_tflops_assumed": peak_tflops,
    }


def engines(dims: dict, device: str, batch: int, plen: int, new: int) -> dict:
    from areal_core.rollout.continuous_engine import ContinuousEngine
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.torch_engine import TorchEngine

    model, _ = model_and_tokenizer(dims, device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (batch, plen), generator=g)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=1)
    no_eos = -1

    def hf() -> None:
        with torch.no_grad():
            p = prompts.to(device)
            model.generate(
                p,
                attention_mask=torch.ones_like(p),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )

    runs = {
        "transformers_generate": hf,
        "torch_engine": lambda: TorchEngine(model, 0, no_eos).generate(prompts.tolist(), params),
        "continuous_engine": lambda: ContinuousEngine(model, 0, no_eos, slots=batch).generate(prompts.tolist(), params),
    }
    return {"batch": batch, "prompt_len": plen, "new_tokens": new, **engine_rates(runs, batch * new, device)}


VLLM_CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=False, gpu_memory_utilization=0.3, enforce_eager=True)
prompts = [[5 + (i * 7 + j) % 40 for j in range(64)] for i in range(int(sys.argv[2]))]
sp = SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True, temperature=1.0)
llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
t0 = time.perf_counter()
out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
n = sum(len(o.outputs[0].token_ids) for o in out)
print(json.dumps({"tok_s": round(n / (time.perf_counter() - t0), 1), "tokens": n}))
"""


def vllm(dims: dict, device: str, batch: int, new: int) -> dict:
    if device != "cuda":
        return {"skipped": "vLLM's GPU engine needs device=cuda (the CPU server is measured by docs/vllm.md)"}
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed in this image"}
    model, tokenizer = model_and_tokenizer(dims, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tokenizer, tmp)
        res = subprocess.run(
            [sys.executable, "-c", VLLM_CHILD, tmp, str(batch), str(new)], capture_output=True, text=True, timeout=300
        )
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def rl(device: str, tiny: bool, steps: int, root: str) -> dict:
    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    overrides = [f"store={root}/rl", f"device={device}", f"train.steps={steps}", "train.eval_every=0"]
    if tiny:
        overrides += [
            "sft.steps=5",
            "task.num_train=200",
            "task.num_eval=20",
            "train.batch_groups=2",
            "rollout.group_size=4",
            "rollout.max_batch_groups=2",
            "rollout.max_new_tokens=8",
        ]
    run_uri, _ = pipeline.prepare(str(ROOT / "configs/default.yaml"), overrides)
    t0 = time.perf_counter()
    pipeline.sft(run_uri)
    sft_s = time.perf_counter() - t0
    store = Store(run_uri)
    cfg = load_run_config(store)
    result = launch(run_uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=1200, progress=False)
    rows = [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]
    last = rows[-min(10, len(rows)) :]
    return {
        "steps": result["step"],
        "sft_s": round(sft_s, 1),
        "rl_wall_s": round(result["wall_s"], 1),
        "s_per_step": round(result["wall_s"] / max(result["step"], 1), 3),
        "train_s_mean": round(sum(r["train_s"] for r in last) / len(last), 4),
        "reward_mean_last": round(sum(r.get("reward_mean", 0.0) for r in last) / len(last), 4),
    }


# benchmarks/scale.py trainer cases of the real_vocab section (name -> arguments)
REAL_VOCAB_CASES = {
    "qwen05b_8x1k": "--shape qwen2.5-0.5b --rows 8 --answer 1024 --steps 3",
    "qwen05b_8x1k_compiled": "--shape qwen2.5-0.5b --rows 8 --answer 1024 --steps 3 --compile",
    "qwen05b_4x4k": "--shape qwen2.5-0.5b --rows 4 --answer 4096 --steps 3",
    "qwen15b_8x1k": "--shape qwen2.5-1.5b --rows 8 --answer 1024 --steps 3",
}
REAL_VOCAB_TINY = {
    "tiny_2x256": "--shape tiny --rows 2 --answer 256 --steps 1",
    "tiny_2x1k": "--shape tiny --rows 2 --answer 1024 --steps 1",
}


def real_vocab(device: str, tiny: bool, peak_tflops: float) -> dict:
    """Each case in its own process (benchmarks/scale.py trainer), its failure recorded alone."""
    out: dict[str, Any] = {}
    for name, args in (REAL_VOCAB_TINY if tiny else REAL_VOCAB_CASES).items():
        cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "trainer", "--device", device, *args.split()]
        cmd += ["--peak-tflops", str(peak_tflops)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
        if proc.returncode == 0:
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            out[name] = {"error": proc.stderr.strip()[-1500:]}
    return out


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tiny", action="store_true", help="the default job's model size and a short RL run")
    parser.add_argument("--out", default="gpu_smoke.json")
    parser.add_argument("--rl-steps", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H200: 989)")
    args = parser.parse_args(argv)
    dims = TINY if args.tiny else SCALED
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "tiny": args.tiny}
    t0 = time.perf_counter()
    section(out, "env", lambda: env(args.device))
    section(out, "trainer", lambda: trainer(dims, args.device, 2 if args.tiny else 10, args.peak_tflops))
    if not args.tiny:  # MFU at a size where the matrices, not Python, set the pace
        section(out, "trainer_qwen05b_shape", lambda: trainer(QWEN05B, args.device, 10, args.peak_tflops, groups=32))
    section(out, "real_vocab", lambda: real_vocab(args.device, args.tiny, args.peak_tflops))
    section(out, "engines", lambda: engines(dims, args.device, 8 if args.tiny else 64, 16, 16 if args.tiny else 128))
    section(out, "vllm", lambda: vllm(dims, args.device, 64, 128))
    section(out, "moe_trainer", lambda: gpu_smoke_moe.moe_trainer(args.device, args.tiny, args.peak_tflops))
    section(out, "moe_engines", lambda: gpu_smoke_moe.moe_engines(args.device, args.tiny))
    section(out, "megatron_ep", lambda: gpu_smoke_moe.megatron_ep(args.device))
    section(out, "delta_codec", lambda: gpu_smoke_codec.delta_codec(args.device, args.tiny))
    with tempfile.TemporaryDirectory() as root:
        steps = args.rl_steps or (3 if args.tiny else 50)
        section(out, "rl", lambda: rl(args.device, args.tiny, steps, root))
    out["total_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items()}, indent=1)[:4000])
    return out


if __name__ == "__main__":
    main()
