"""GRPO on the pretrained SmolLM2-135M-Instruct (no SFT) on the embedded arithmetic problems as
chat questions: held-out accuracy before and after RL, RL wall time, seconds per step.

    PYTHONPATH=. .venv/bin/python benchmarks/smollm2_rl.py probe [--n 64] [--out probe.json]
    PYTHONPATH=. .venv/bin/python benchmarks/smollm2_rl.py run [--modes lora,full] [--eval 200] [overrides...]

The config's run is LoRA (train.lora_rank in configs/smollm2_arithmetic.yaml); mode "full" runs
--timing-steps steps of full fine-tuning (delta publication) for the per-step comparison only.

probe (the measurements the config's numbers come from, one process, torch threads = --threads):
  - the natural answer length: greedy answers to --n held-out questions with up to --max-new
    tokens: the length distribution to <|im_end|>, the share that ended, and the greedy accuracy
    if answers were cut at each candidate completion length;
  - sampled (temperature --temperature, --group samples a question): mean reward and the share of
    groups with mixed rewards (the groups GRPO learns from);
  - generation speed of the continuous engine, fp32 vs bf16 weights;
  - one training step (forward + backward + AdamW) on a GRPO batch of that length: full vs
    LoRA, fp32 vs bf16 autocast.
run: for each mode, a run root from configs/smollm2_arithmetic.yaml (+ the mode's overrides + the
  given ones): held-out greedy accuracy on --eval problems before (init_model) and after
  (final_model) with the continuous engine, the RL wall time (the launcher: trainer, rollout and
  reward processes), and per step: generation (the rollout worker's samples/s → seconds for one
  step's batch), training and publication (the trainer's metrics), and the published bytes.
Prints one RESULT line per mode and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

from areal_core.config import load_config
from areal_core.reward.math import gsm8k_reward
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from task_data.registry import load_task

CONFIG = "configs/smollm2_arithmetic.yaml"
# mode -> overrides; "full" is a timing run (per-step phases of full fine-tuning with delta
# publication), its accuracy after a few steps is not a result
MODES = {"lora": [], "full": ["train.lora_rank=0", "train.weight_delta=true", "train.lr=1e-5"]}
TIMING_ONLY = {"full"}


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"


def load_model(path: str, dtype=torch.float32):
    from areal_core.models import load_pretrained

    model, tok = load_pretrained(path)
    return model.to(dtype).eval(), tok


def prompts_of(tok, records: list[dict], system: str) -> list[list[int]]:
    from areal_core.models import chat_prompt

    return [chat_prompt(tok, r["prompt"], system) for r in records]


def grade(tok, records: list[dict], token_lists: list[list[int]]) -> list[float]:
    return [gsm8k_reward(tok.decode(t, skip_special_tokens=True), r["answer"]) for r, t in zip(records, token_lists)]


def greedy_accuracy(model, tok, records: list[dict], system: str, max_new: int, slots: int = 64) -> float:
    engine = ContinuousEngine(model, tok.pad_token_id, tok.eos_token_id, slots=slots)
    gens = engine.generate(prompts_of(tok, records, system), SamplingParams(max_new_tokens=max_new, greedy=True))
    return statistics.mean(grade(tok, records, [g.token_ids for g in gens]))


# -- probe ------------------------------------------------------------------------------------------
def probe(args) -> dict[str, Any]:
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(args.threads)
    _, records = load_task(cfg.task, cfg.seed)
    records = records[: args.n]
    system = cfg.task.system_prompt
    from areal_core.models import localize

    path = localize(cfg.model.path)
    model, tok = load_model(path)
    ps = prompts_of(tok, records, system)
    out: dict[str, Any] = {"machine": machine(), "n": len(records), "prompt_tokens": statistics.mean(map(len, ps))}

    engine = ContinuousEngine(model, tok.pad_token_id, tok.eos_token_id, slots=len(ps))
    t0 = time.perf_counter()
    gens = engine.generate(ps, SamplingParams(max_new_tokens=args.max_new, greedy=True))
    dt = time.perf_counter() - t0
    lengths = sorted(len(g.token_ids) for g in gens)
    ended = [g.finish_reason == "stop" for g in gens]
    q = statistics.quantiles(lengths, n=10)
    out["greedy"] = {
        "length_p10_p50_p90": [q[0], statistics.median(lengths), q[-1]],
        "length_max": lengths[-1],
        "ended_share": sum(ended) / len(ended),
        "accuracy_if_cut_at": {
            str(c): statistics.mean(grade(tok, records, [g.token_ids[:c] for g in gens]))
            for c in (32, 48, 64, 96, 128, 192, args.max_new)
            if c <= args.max_new
        },
        "fp32_tokens_per_s": sum(lengths) / dt,
    }
    print("greedy", json.dumps(out["greedy"]), flush=True)
    examples = [tok.decode(g.token_ids) for g in gens[:3]]
    print("examples", json.dumps(examples), flush=True)

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    engine16 = ContinuousEngine(bf16, tok.pad_token_id, tok.eos_token_id, slots=len(ps))
    t0 = time.perf_counter()
    g16 = engine16.generate(ps, SamplingParams(max_new_tokens=args.max_new, greedy=True))
    dt16 = time.perf_counter() - t0
    out["greedy"]["bf16_tokens_per_s"] = sum(len(g.token_ids) for g in g16) / dt16
    out["greedy"]["bf16_accuracy"] = statistics.mean(grade(tok, records, [g.token_ids for g in g16]))
    del bf16, engine16

    k = max(1, args.n // args.group)
    sub = records[:k]
    sp = SamplingParams(max_new_tokens=args.completion, temperature=args.temperature, seed=cfg.seed)
    t0 = time.perf_counter()
    sampled = engine.generate([p for p in ps[:k] for _ in range(args.group)], sp)
    sample_s = time.perf_counter() - t0
    rewards = grade(tok, [r for r in sub for _ in range(args.group)], [g.token_ids for g in sampled])
    groups = [rewards[i * args.group : (i + 1) * args.group] for i in range(k)]
    out["sampled"] = {
        "temperature": args.temperature,
        "completion": args.completion,
        "mean_reward": statistics.mean(rewards),
        "mixed_groups": sum(0 < sum(g) < len(g) for g in groups) / k,
        "seconds": sample_s,
        "samples": len(sampled),
    }
    print("sampled", json.dumps(out["sampled"]), flush=True)

    batch = [p + g.token_ids for p, g in zip([p for p in ps[:k] for _ in range(args.group)], sampled)]
    out["train_step_s"] = train_step_times(model, tok, batch[: args.train_batch])
    print("train_step_s", json.dumps(out["train_step_s"]), flush=True)
    return out


def train_step_times(model, tok, seqs: list[list[int]]) -> dict[str, float]:
    """Seconds of one forward + backward + AdamW step on `seqs` (padded batch), per variant."""
    from areal_core.train.lora import apply_lora

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    out = {"sequences": len(seqs), "tokens": int(mask.sum())}
    for name, lora, bf16 in [
        ("full_fp32", False, False),
        ("full_bf16", False, True),
        ("lora_fp32", True, False),
        ("lora_bf16", True, True),
    ]:
        m = copy.deepcopy(model).train()
        if lora:
            m = apply_lora(m, r=16, alpha=32)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6)
        times = []
        for _ in range(2):  # the first step allocates the optimizer state
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = m(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(logp * mask[:, 1:]).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = times[-1]
        print(name, round(times[-1], 1), flush=True)
        del m, opt
    return out


# -- run --------------------------------------------------------------------------------------------
def run(args) -> list[dict[str, Any]]:
    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.logs import setup_logging
    from areal_core.models import localize
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store

    setup_logging()
    results = []
    for mode in args.modes.split(","):
        base = ["tracking.enabled=false", "launcher.progress=false", f"store={args.root}/{mode}"]
        steps = [f"train.steps={args.timing_steps}"] if mode in TIMING_ONLY else []
        run_uri, _ = pipeline.prepare(args.config, [*base, *MODES[mode], *steps, *args.overrides])
        pipeline.sft(run_uri)  # sft.enabled=false: copies model.path as init_model
        store = Store(run_uri)
        cfg = load_run_config(store)
        torch.set_num_threads(args.threads)
        _, heldout = load_task(cfg.task, cfg.seed)
        heldout = heldout[: args.eval]
        system, max_new = cfg.task.system_prompt, cfg.eval.max_new_tokens
        t0 = time.time()
        model, tok = load_model(localize(store.url(LAYOUT.init_model)))
        before = greedy_accuracy(model, tok, heldout, system, max_new) if mode not in TIMING_ONLY else float("nan")
        eval_s = time.time() - t0
        del model
        print(f"{mode}: held-out before {before:.3f} ({eval_s:.0f} s)", flush=True)
        t0 = time.time()
        launch(run_uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=args.timeout, progress=False)
        wall = time.time() - t0
        after = float("nan")
        if mode not in TIMING_ONLY:
            model, tok = load_model(localize(store.url(LAYOUT.final_model)))
            after = greedy_accuracy(model, tok, heldout, system, max_new)
        rows = [json.loads(x) for x in store.read_text(LAYOUT.metrics).splitlines() if x]
        phases = event_phases(store, len(rows))
        res = {
            "mode": mode,
            "overrides": [*MODES[mode], *args.overrides],
            "machine": machine(),
            "eval_n": len(heldout),
            "before": before,
            "after": after,
            "rl_wall_s": wall,
            "steps": len(rows),
            "train_s_per_step": statistics.median(r["train_s"] for r in rows),
            **phases,
            "reward_curve": [round(r.get("reward_mean", float("nan")), 3) for r in rows],
        }
        results.append(res)
        print(
            f"RESULT {mode} before={before:.3f} after={after:.3f} wall={wall:.0f}s steps={len(rows)} "
            f"gen={res['generate_s_per_step']:.1f}s/step train={res['train_s_per_step']:.1f}s/step "
            f"publish={res['publish_s']:.2f}s loaded={res['publish_to_loaded_s']:.2f}s bytes={res['published_bytes']}",
            flush=True,
        )
    return results


def event_phases(store, steps: int) -> dict[str, float]:
    """From the run's events (areal_core/events.py): the rollout worker's busy generating time per
    trained step, the publish time and bytes (median over versions), and publish → loaded: from the
    trainer's `publish` record of a version to the rollout worker's `load` record of it (read,
    verified and staged; installed at the engine's next step)."""
    from areal_core.events import read_events

    events = read_events(store)
    gen = sum(
        e["t1"] - e["t0"] for e in events if e["role"] == "rollout" and e["kind"] == "span" and e["on"] == "generate"
    )
    pub = {e["version"]: e for e in events if e["kind"] == "publish" and e["version"] > 0}
    loads = {e["version"]: e["t"] for e in events if e["kind"] == "load" and e["role"] == "rollout"}
    lag = [loads[v] - p["t"] for v, p in pub.items() if v in loads]
    return {
        "generate_s_per_step": gen / max(steps, 1),
        "publish_s": statistics.median(p["seconds"] for p in pub.values()) if pub else float("nan"),
        "published_bytes": statistics.median(p["bytes"] for p in pub.values()) if pub else 0,
        "publish_to_loaded_s": statistics.median(lag) if lag else float("nan"),
        "versions_loaded": len(lag),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--train-batch", type=int, default=32)
    r = sub.add_parser("run")
    r.add_argument("--modes", default="lora,full")
    r.add_argument("--eval", type=int, default=200)
    r.add_argument("--root", default="runs/smollm2-rl")
    r.add_argument("--timeout", type=float, default=3600)
    r.add_argument("--timing-steps", type=int, default=6, help="RL steps of the timing-only modes (full)")
    for q in (p, r):
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--config", default=CONFIG)
        q.add_argument("--out", default="")
        q.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = probe(args) if args.cmd == "probe" else run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
