"""The compiled trainer step (train.compile, areal_core/train/compiled_step.py) against the eager
one, by CPU time, at a job's shapes: what a cold compile costs, what a step saves, and after how
many steps the compile is repaid.

    PYTHONPATH=. .venv/bin/python benchmarks/train_compile.py [--job default|smollm2] [--steps 40]
                                                              [--repeats 1] [--threads 1] [--out f.json]

Each mode runs in a fresh process (`--child eager|compiled`): the job's policy (the default job's
tiny Qwen2 from configs/default.yaml, or SmolLM2-135M with the config's LoRA and bf16 autocast)
and its optimizer take `--steps` train_step calls on synthetic GRPO batches of the job's shapes
(groups × group size samples, a shared prompt and responses of random lengths: the default job's
~25-token prompts and up to 24 response tokens; SmolLM2's ~56-token chat prompts and up to 64),
the same batches in both modes. The compiled process starts with an empty inductor cache (a cold
compile, as on a fresh pod) and compiles in-process (compile_threads = 1), so its CPU time (own +
waited children: gcc) holds all of the compile. Reported per mode: CPU-s of the first step and
the median of the others; compiled: the compile's CPU-s (first step − median step), the graphs
dynamo compiled over the run (a recompile shows as a graph more), the mean |Δ log p| between the
compiled and the eager forward on the first batch (float32, no autocast), and the break-even step
count = compile CPU-s / (eager − compiled CPU-s per step). The CPU (lscpu) and the load average
go with every figure: the machine is shared, so CPU time, not wall time, is the measure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

JOBS = {  # config, groups, group size, prompt length range, response length range, vocabulary
    "default": ("configs/default.yaml", 8, 8, (18, 30), (4, 24), 384),
    "smollm2": ("configs/smollm2_arithmetic.yaml", 4, 8, (50, 62), (16, 64), 49152),
}


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the compiler's gcc runs)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def batches(job: str, steps: int, seed: int = 0) -> list:
    """`steps` synthetic GRPO batches of `job`'s shapes (module docstring)."""
    from areal_core.protocol import Sample

    _, groups, size, plen, rlen, vocab = JOBS[job]
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        samples = []
        for g in range(groups):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*plen))]
            for k in range(size):
                resp = [rng.randrange(3, vocab) for _ in range(rng.randint(*rlen))]
                n_p, n_r = len(prompt), len(resp)
                samples.append(
                    Sample(
                        sample_id=f"{step}-{g}-{k}",
                        group_id=f"{step}-{g}",
                        prompt_id=f"p{g}",
                        worker_id="w",
                        input_ids=prompt + resp,
                        prompt_len=n_p,
                        loss_mask=[0] * n_p + [1] * n_r,
                        behav_logprobs=[0.0] * n_p + [rng.uniform(-6.0, -0.1) for _ in range(n_r)],
                        versions=[-1] * n_p + [0] * n_r,
                        reward=float(rng.random() < 0.5),
                    )
                )
        out.append(samples)
    return out


def policy(job: str):
    """(model, optimizer, config, bf16) of `job`'s trainer."""
    import torch

    from areal_core.config import load_config
    from areal_core.config.device import use_bf16
    from areal_core.models import build_tiny_model, load_pretrained
    from areal_core.pretrained import ensure
    from areal_core.train.lora import with_lora

    cfg = load_config(JOBS[job][0], [])
    if job == "default":
        model = build_tiny_model(cfg.model, JOBS[job][5], cfg.seed)
    else:
        model, _ = load_pretrained(str(ensure("smollm2")), "cpu")
        model, _ = with_lora(model, cfg.train)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr)
    return model, opt, cfg, use_bf16(cfg.train.bf16_autocast, "cpu")


def logprob_gap(model, cfg, samples, compiled) -> float:
    """Mean |Δ log p| over response tokens, compiled vs eager forward, float32 (no autocast)."""
    import torch

    from areal_core.train.batch import collate
    from areal_core.train.step import policy_logprobs

    batch = collate(samples, 0)
    with torch.no_grad():
        eager = policy_logprobs(model, batch, None, cfg, 0)
        with compiled.active():
            comp = policy_logprobs(model, batch, None, cfg, 0)
    mask = batch.loss_mask.float()
    return float(((eager - comp).abs() * mask).sum() / mask.sum())


def child(job: str, mode: str, steps: int, threads: int) -> dict:
    """One process's run of `steps` train steps in `mode` (module docstring)."""
    import torch
    import torch._inductor.config as inductor

    from areal_core.train.compiled_step import CompiledDecoder, graph_count
    from areal_core.train.step import train_step

    torch.set_num_threads(threads)
    inductor.compile_threads = 1  # the compile in this process, its CPU time in ours
    model, opt, cfg, bf16 = policy(job)
    compiled = CompiledDecoder(model, mode == "compiled", mode)
    per_step = []
    for samples in batches(job, steps):
        t = cpu_s()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16), compiled.active():
            train_step(model, opt, samples, cfg, 0)
        per_step.append(cpu_s() - t)
    median = statistics.median(per_step[1:])
    out = {"job": job, "mode": mode, "steps": steps, "first_cpu_s": per_step[0], "median_cpu_s": median}
    out |= {"min_cpu_s": min(per_step[1:]), "bf16": bf16, "graphs": graph_count(), "still_compiled": compiled.on}
    if mode == "compiled":
        out["compile_cpu_s"] = per_step[0] - median
        out["mean_abs_dlogp_fp32"] = logprob_gap(model, cfg, batches(job, 1, seed=99)[0], compiled)
        out["graphs_after_check"] = graph_count()
    return out


def run_child(job: str, mode: str, steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
        cmd = [sys.executable, __file__, "--child", mode, "--job", job, "--steps", str(steps)]
        cmd += ["--threads", str(threads)]
        t0 = time.time()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
    return res | {"wall_s": time.time() - t0, "load_avg": os.getloadavg()}


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")
    return f"{name}, {os.cpu_count()} CPUs"


def summary(runs: list[dict]) -> dict:
    """Best-of-repeats per mode and the break-even step count."""
    best = {m: min((r for r in runs if r["mode"] == m), key=lambda r: r["median_cpu_s"]) for m in ("eager", "compiled")}
    saved = best["eager"]["median_cpu_s"] - best["compiled"]["median_cpu_s"]
    compile_s = min(r["compile_cpu_s"] for r in runs if r["mode"] == "compiled")
    return {
        "eager_cpu_s_per_step": best["eager"]["median_cpu_s"],
        "compiled_cpu_s_per_step": best["compiled"]["median_cpu_s"],
        "saved_cpu_s_per_step": saved,
        "compile_cpu_s": compile_s,
        "break_even_steps": compile_s / saved if saved > 0 else float("inf"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=sorted(JOBS), default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=("eager", "compiled"), default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.job, args.child, args.steps, args.threads)))
        return
    runs = []
    for _ in range(args.repeats):
        for mode in ("eager", "compiled"):
            runs.append(run_child(args.job, mode, args.steps, args.threads))
            print(json.dumps(runs[-1]), flush=True)
    result = {"cpu": cpu_name(), "job": args.job, "threads": args.threads, "runs": runs, **summary(runs)}
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
