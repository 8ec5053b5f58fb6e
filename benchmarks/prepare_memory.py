"""Prepare's peak memory against the size of the checkpoint it checks (docs/cluster.md, "The prepare
pod's memory"; tests/test_prepare_memory.py holds it to one copy).

    PYTHONPATH=. .venv/bin/python benchmarks/prepare_memory.py           # SmolLM2-135M and a tiny Llama
    PYTHONPATH=. .venv/bin/python benchmarks/prepare_memory.py child PATH WARMUP_PATH|"" [OVERRIDE ...]  # one

Each measurement is a fresh process: it imports what prepare imports, reads its resident set (RSS),
runs `pipeline.prepare` on the checkpoint at PATH with LoRA on and each rollout engine and dtype of
ENGINES (every check that needs the weights runs: the LoRA targets, the agreement in float32 and,
for bfloat16, in bfloat16 too), and reads the process's peak RSS (VmHWM).
It prints one JSON line:
weights_mb (the checkpoint's weights in float32), start_mb (RSS after the imports), peak_mb and
growth_mb = peak_mb - start_mb.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK_OVERRIDES = ["sft.enabled=false", "train.lora_rank=8"]
ENGINES = [  # (rollout.engine, rollout.dtype): the continuous engine fuses its own qkv and gate/up matrices
    ("torch", "float32"),
    ("auto", "float32"),
    ("auto", "bfloat16"),
]


def _current_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's peak resident set (VmHWM of /proc/self/status), in MiB. Not getrusage's ru_maxrss:
    Linux carries the parent's high-water mark into a child across fork and execve, so a child of a
    large process (a pytest worker that ran other tests) reports the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(path: str, overrides: list[str], warmup: str = "") -> dict[str, float]:
    """Run prepare on the checkpoint at `path` in this process; its memory, in MiB. `warmup`: a
    checkpoint prepared first, so that what the first prepare of a process loads once (modules,
    the task's code, first-use caches) is not counted in growth_mb."""
    import torch  # noqa: F401 - the imports prepare makes, before the start is read
    import transformers  # noqa: F401
    from peft import LoraConfig  # noqa: F401

    from areal_core.rollout import continuous_engine, torch_engine  # noqa: F401
    from areal_core.run import pipeline

    with tempfile.TemporaryDirectory(prefix="areal-prepare-memory-") as tmp:
        if warmup:
            pipeline.prepare("", [f"store={tmp}/warm", f"model.path={warmup}", *CHECK_OVERRIDES, *overrides])
        start = _current_mb()
        pipeline.prepare("", [f"store={tmp}/run", f"model.path={path}", *CHECK_OVERRIDES, *overrides])
    peak = _peak_mb()
    return {
        "weights_mb": float32_weight_bytes(path) / 2**20,
        "start_mb": start,
        "peak_mb": peak,
        "growth_mb": peak - start,
    }


def float32_weight_bytes(folder: str | Path) -> int:
    """4 bytes per parameter of the safetensors files in `folder` (their headers only)."""
    from safetensors import safe_open

    total = 0
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                numel = 1
                for dim in st.get_slice(name).get_shape():
                    numel *= dim
                total += 4 * numel
    return total


def measure(path: str | Path, overrides: list[str] = (), warmup: str | Path = "") -> dict[str, float]:
    """`child` in a fresh process (so its VmHWM is prepare's own peak)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", str(path), str(warmup), *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"prepare failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_llama(out_dir: str | Path, hidden: int = 512, layers: int = 8) -> Path:
    """A random Llama checkpoint of about 100 MB in float32 (hidden 512, 8 layers; the test's size)."""
    import transformers

    from benchmarks import tiny_checkpoints as tc

    tok = tc.tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    out = Path(out_dir)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main() -> None:
    from areal_core import pretrained

    with tempfile.TemporaryDirectory(prefix="areal-tiny-llama-") as tmp:
        cases = {"tiny Llama (hidden 512, 8 layers)": tiny_llama(tmp), "SmolLM2-135M": pretrained.ensure("smollm2")}
        for name, path in cases.items():
            for engine, dtype in ENGINES:
                got = measure(path, [f"rollout.engine={engine}", f"rollout.dtype={dtype}"])
                row = {k: round(v, 1) for k, v in got.items()}
                print(f"{name}, rollout.engine={engine} rollout.dtype={dtype}:", json.dumps(row), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[4:], sys.argv[3])))
    else:
        main()
