"""Projection (issue 45): does the store keep up with a 7B or 32B policy's versions? The pipeline
simulator (areal_core/sim: the real admission and staleness rules) runs one run shape with each
way of publishing, and compares its throughput with the same run whose weights cost nothing.

    PYTHONPATH=. .venv/bin/python benchmarks/store_projection.py [--delta-frac 0.03] [--codec-gbps 0.5]

Assumptions, all stated in the output: H100s at 40% MFU (989 TFLOP/s bf16 peak) for training
(6·N FLOP a token) and prefill (2·N), decode memory-bound at 3.35 TB/s (a step reads the bf16
weights once); 16 trainer GPUs, 64 rollout workers of 64 slots, B = 64 groups of 16, 256-token
prompts, the simulator's default answer lengths, η = 4. A version is written once by the trainer
and read by every rollout worker at the store's bandwidth per client (1 or 10 GB/s); a delta also
costs its encoding and decoding at `--codec-gbps` of bf16 input (this repo's codec on the benchmark
machine: measure with benchmarks/weight_density.py --codec). `--delta-frac` is
a delta's size as a fraction of a full bf16 file (benchmarks/weight_density.py at lr 1e-5).
"""

from __future__ import annotations

import argparse
import json

from areal_core.sim.cluster import SimConfig, simulate
from areal_core.sim.costs import DecodeCost, TrainCost

PEAK, MFU, HBM = 989e12, 0.40, 3.35e12


def shape(params: float) -> SimConfig:
    train = TrainCost(tokens_per_s_per_worker=MFU * PEAK / (6 * params), step_overhead_s=2.0, publish_s=0.0)
    decode = DecodeCost(base_s=2 * params / HBM, per_seq_s=0.00025, prefill_tokens_per_s=MFU * PEAK / (2 * params))
    return SimConfig(steps=40, warmup_steps=8, train=train, decode=decode, weight_sync_s=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delta-frac", type=float, default=0.03)
    ap.add_argument("--codec-gbps", type=float, default=0.5)
    a = ap.parse_args()
    rows = []
    for name, params in (("7B", 7.6e9), ("32B", 32.8e9)):
        base = shape(params)
        free = simulate(base)
        step_s = base.train.step_s(base.batch_groups * base.group_size * 700, base.trainer_workers)
        for gbps in (1.0, 10.0):
            for mode, nbytes, codec_s in (
                ("fp32 full", 4 * params, 0.0),
                ("bf16 full", 2 * params, 0.0),
                ("bf16 delta", 2 * params * a.delta_frac, 2 * params / (a.codec_gbps * 1e9)),
            ):
                transfer = nbytes / (gbps * 1e9)
                cfg = base.replace(
                    train=TrainCost(base.train.tokens_per_s_per_worker, base.train.step_overhead_s, transfer + codec_s),
                    weight_sync_s=transfer + codec_s,
                )
                res = simulate(cfg)
                rows.append(
                    {
                        "model": name,
                        "store_gbps": gbps,
                        "publish": mode,
                        "version_gb": round(nbytes / 1e9, 2),
                        "publish_s": round(transfer + codec_s, 1),
                        "load_s": round(transfer + codec_s, 1),
                        "approx_step_s": round(step_s, 1),
                        "throughput_vs_free": round(res.throughput / free.throughput, 3),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    print(
        "| model | store GB/s per client | publication | version GB | publish s | load s | step s (approx.) | "
        "throughput / weights free |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['store_gbps']:g} | {r['publish']} | {r['version_gb']} | {r['publish_s']} | "
            f"{r['load_s']} | {r['approx_step_s']} | {r['throughput_vs_free']:.0%} |"
        )


if __name__ == "__main__":
    main()
