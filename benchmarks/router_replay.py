"""Routing replay over one short run (issue 55): a tiny Qwen3-MoE with Qwen3-30B-A3B-like routing
(64 experts, top-8), sampled by a bfloat16 torch engine and trained in float32 with
algo.router_replay=rollout; per step, the trainer's route metrics (areal_core/train/router_replay.py).

    PYTHONPATH=. python benchmarks/router_replay.py --steps 8 --eta 0 --out /tmp/router_replay.json

The table docs/benchmarks.md ("Routing replay") shows: routing agreement (the share of token-layers
where the float32 trainer's own router picks the engine's experts), the behaviour gap mean
|log π_prox − log π_behav| and the importance weight's spread (std of π_prox/π_behav over the policy
tokens) under the trainer's own routes and under the rollout's, and the loss's importance-weight
min/max (computed under replay). The checkpoint's experts are drawn at std 0.1 (transformers' 0.02
leaves a random expert's output too small to move a log-prob): its experts carry the residual
stream, as a trained MoE's do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

from areal_core.layout import LAYOUT
from areal_core.models import build_tokenizer
from areal_core.store import Store

EXPERTS, TOP_K, EXPERT_STD = 64, 8, 0.1
CORPUS = [f"What is {a} + {b}? The answer is {a + b}.\n#### {a + b}" for a in range(10) for b in range(10)]
RUN = [
    "task.num_train=400",
    "task.num_eval=40",
    "task.min_value=1",
    "task.max_value=9",
    "sft.enabled=false",
    "rollout.engine=torch",
    "rollout.dtype=bfloat16",
    "rollout.group_size=4",
    "rollout.max_batch_groups=2",
    "rollout.max_new_tokens=16",
    "train.batch_groups=2",
    "train.checkpoint_every=2",
    "eval.num_samples=20",
    "eval.max_new_tokens=8",
    "tracking.enabled=false",
    "launcher.progress=false",
    "reward.timeout_s=60",
    "reward.function=benchmarks.router_replay:hash_reward",
]
COLUMNS = [
    "route_agreement",
    "abs_dlogp_behav_own",
    "abs_dlogp_behav_replay",
    "iw_std_own",
    "iw_std_replay",
    "importance_weight_min",
    "importance_weight_max",
]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def hash_reward(completion: str) -> float:
    """1 for about a third of completions, by a stable hash: mixed groups, so every step trains."""
    return float(int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 3 == 0)


def tiny_moe(tokenizer, seed: int = 0) -> torch.nn.Module:  # noqa: ANN001
    """A float32 Qwen3-MoE of the transformers class: 2 layers 64 wide, 64 experts, top-8, experts at std 0.1."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=32,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, EXPERT_STD)
    return model


def save_checkpoint(out: Path, seed: int = 0) -> Path:
    """The tiny MoE and a byte-level BPE tokenizer with a chat template, as a hub download looks."""
    tokenizer = build_tokenizer(CORPUS, 300)
    tiny_moe(tokenizer, seed).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def run(root: Path, steps: int, replay: str, extra: list[str] = ()) -> list[dict]:
    """One run to DONE (`extra`: more overrides); its metrics rows."""
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch

    ckpt = save_checkpoint(root / "ckpt")
    overrides = [*RUN, f"store={root / 'run'}", f"model.path={ckpt}", f"train.steps={steps}"]
    run_uri, _ = pipeline.prepare("", [*overrides, f"algo.router_replay={replay}", *extra])
    pipeline.sft(run_uri)
    launch(run_uri, 1, 1, timeout_s=1200, progress=False)
    store = Store(run_uri)
    if not store.done():
        raise SystemExit("the run did not reach DONE")
    return [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]


def table(rows: list[dict]) -> str:
    head = ["step", "agreement", "|Δ log p| own", "|Δ log p| replay", "w std own", "w std replay", "w min", "w max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([str(r["step"])] + [f"{float(r[c]):.4g}" for c in COLUMNS]) + " |")
    mean = [sum(float(r[c]) for r in rows) / len(rows) for c in COLUMNS]
    lines.append("| mean | " + " | ".join(f"{v:.4g}" for v in mean) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--replay", default="rollout", choices=["rollout", "none"])
    ap.add_argument("--eta", type=int, default=0, help="train.eta (0: every sample from the trainer's own version)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="areal-router-replay-") as tmp:
        rows = run(Path(tmp), args.steps, args.replay, [f"train.eta={args.eta}", f"train.lr={args.lr}"])
    from areal_core.report.doctor import routing_drift

    findings = [f.line() for f in routing_drift(rows)]
    print(table(rows))
    print("\n".join(findings) or "(the doctor finds no routing drift)")
    result = {
        "replay": args.replay,
        "steps": args.steps,
        "eta": args.eta,
        "lr": args.lr,
        "rows": [{"step": r["step"], **{c: r[c] for c in COLUMNS}} for r in rows],
        "doctor": findings,
        "wall_s": round(time.perf_counter() - t0, 1),
        "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
