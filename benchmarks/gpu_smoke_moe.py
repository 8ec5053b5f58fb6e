"""benchmarks/gpu_smoke.py's mixture-of-experts sections (issue 55), run when a device is lent.

  moe_trainer   `train_step` on a Qwen3-30B-A3B-like model scaled to one GPU: its widths, its 128
                experts and top-8 routing, its hidden : expert-width ratio (2048 : 768), 4 of its 48
                layers (~2.5B parameters, ~40 GB with float32 Adam states); tokens/s and
                MFU = 6 · N_active · tokens/s / peak FLOP/s, where only the active parameters count:
                N_active = N_total − N_experts · (1 − k / E) (N_experts: the routed experts'
                parameters, k of E used per token);
  moe_engines   the torch and continuous engines on the same model, tokens/s;
  megatron_ep   a tiny Qwen3-MoE through megatron-core at expert parallel 2
                (`python -m areal_core.megatron.ep_check CASE OUT --device cuda`, docs/megatron.md),
                with the interpreter that imports megatron-core (this one or .venv-megatron's),
                else skipped with the reason.
`--tiny` (the CPU fallback the tests run): hidden 64, 2 layers, 16 experts, top-4, expert width 24.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# Qwen3-30B-A3B (hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128 experts, top-8, width 768), 4 layers
QWEN3_30B_A3B_SCALED = dict(
    hidden_size=2048,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    norm_topk_prob=True,
)
TINY_MOE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=24,
    intermediate_size=128,
    norm_topk_prob=True,
)


def active_params(total: int, expert_params: int, top_k: int, num_experts: int) -> float:
    """The parameters one token uses: N_active = N_total − N_experts · (1 − k / E)."""
    return total - expert_params * (1 - top_k / num_experts)


def moe_model(dims: dict[str, Any], device: str) -> torch.nn.Module:
    """A random float32 Qwen3-MoE (transformers' class) with the tiny checkpoints' vocabulary."""
    import transformers

    from benchmarks import tiny_checkpoints

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=tiny_checkpoints.VOCAB, max_position_embeddings=4096, **dims)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().to(device)


def _expert_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)


def moe_trainer(device: str, tiny: bool, peak_tflops: float) -> dict[str, Any]:
    from areal_core.config import load_config
    from areal_core.train.parts import make_optimizer
    from areal_core.train.step import train_step
    from benchmarks.gpu_smoke import sync, synthetic_batch

    dims = TINY_MOE if tiny else QWEN3_30B_A3B_SCALED
    cfg = load_config(None, [f"device={device}", "train.batch_groups=8", "rollout.group_size=8"])
    model = moe_model(dims, device).train()
    optimizer = make_optimizer(model, cfg, distributed=False)
    batch = synthetic_batch(model.config.vocab_size, 2 if tiny else 8, 8, 64, 64)
    tokens, steps = sum(len(s.input_ids) for s in batch), 1 if tiny else 5
    for timed in (False, True):  # the warm-up step runs under the same autocast as the timed ones
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps if timed else 1):
            with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
                train_step(model, optimizer, batch, cfg, 0)
        sync(device)
    tok_s = tokens * steps / (time.perf_counter() - t0)
    total = sum(p.numel() for p in model.parameters())
    active = active_params(total, _expert_params(model), dims["num_experts_per_tok"], dims["num_experts"])
    mfu = 6 * active * tok_s / (peak_tflops * 1e12) if device == "cuda" else None
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {
        "shape": dims,
        "params": total,
        "active_params": int(active),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tok_s, 1),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_tflops_assumed": peak_tflops,
        "peak_gib": None if peak is None else round(peak, 1),
    }


def moe_engines(device: str, tiny: bool) -> dict[str, Any]:
    from areal_core.rollout.continuous_engine import ContinuousEngine
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.torch_engine import TorchEngine
    from benchmarks.gpu_smoke import engine_rates

    batch, plen, new = (4, 16, 8) if tiny else (32, 64, 128)
    model = moe_model(TINY_MOE if tiny else QWEN3_30B_A3B_SCALED, device).eval()
    prompts = torch.randint(3, model.config.vocab_size, (batch, plen), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=1)
    runs = {
        "torch_engine": lambda: TorchEngine(model, 0, -1).generate(prompts.tolist(), params),
        "continuous_engine": lambda: ContinuousEngine(model, 0, -1, slots=batch).generate(prompts.tolist(), params),
    }
    return {"batch": batch, "prompt_len": plen, "new_tokens": new, **engine_rates(runs, batch * new, device)}


def megatron_python() -> str | None:
    """An interpreter that imports megatron-core: this one, else the megatron venv's, else None."""
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return sys.executable
    venv = Path(os.environ.get("AREAL_MEGATRON_VENV", ROOT / ".venv-megatron")) / "bin" / "python"
    return str(venv) if venv.exists() else None


def megatron_ep(device: str) -> dict[str, Any]:
    from areal_core.megatron.moe import ep_case
    from benchmarks import tiny_checkpoints

    python = megatron_python()
    if python is None:
        return {"skipped": "megatron-core imports nowhere here (scripts/setup_megatron_venv.sh builds .venv-megatron)"}
    model = tiny_checkpoints.model("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(ep_case(model, ids), Path(tmp) / "case.pt")
        cmd = [python, "-m", "areal_core.megatron.ep_check", f"{tmp}/case.pt", f"{tmp}/out", "--device", device]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:], "call": " ".join(cmd[1:])}
        result = json.loads((Path(tmp) / "out" / "ep_check.json").read_text())
    return {"call": "python -m areal_core.megatron.ep_check CASE.pt OUT --device " + device, **result}
