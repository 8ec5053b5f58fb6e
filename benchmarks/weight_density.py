"""bf16 deltas (issue 45): how much of a version changes from one step to the next, and what a
version costs to publish and load, in float32 and in bfloat16, on SmolLM2-135M-Instruct full
fine-tuning.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_density.py [--lrs 1e-6 1e-5 1e-4] [--steps 5] [--s3]

Per learning rate: a chain of `--steps` + 1 versions from AdamW steps (the trainer's betas, after
one warm-up step so Adam's first ±lr step is not measured) on the SFT loss of arithmetic chat
questions (benchmarks/weight_transfer.py: pretrained_chain). Each chain is published with
WeightPublisher(delta=True) in float32 and in bfloat16 (cast from the fp32 master, as the trainer
does with train.weight_dtype=bfloat16) to a local folder (and with --s3 a moto server started
here), and read back by a reader following every version (reader.load_state_dict). Per version:
the stored bytes against a full file of the dtype, the density (elements whose bits changed), the
publish and load seconds; every rebuilt version is checked bit for bit against the cast bytes.
One JSON line per (lr, dtype, store), then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid

import numpy as np

from areal_core.store import Store
from areal_core.weights.publisher import WeightPublisher, cast_safetensors
from areal_core.weights.reader import load_state_dict, load_weights_bytes
from benchmarks.moto_local import start_moto

SIDE = {"config.json": b'{"model_type": "llama"}'}


def density(old: bytes, new: bytes) -> float:
    """Fraction of the data's 2- or 4-byte elements whose bits differ (headers are equal)."""
    start = 8 + int.from_bytes(new[:8], "little")
    width = 2 if b'"BF16"' in new[:start] else 4
    dt = np.dtype(f"<u{width}")
    a, b = np.frombuffer(old, dt, offset=start), np.frombuffer(new, dt, offset=start)
    return float((a != b).mean())


def measure(store: Store, versions: list[bytes], dtype: str) -> dict:
    pub = WeightPublisher(store, SIDE, delta=True, full_every=10**6, dtype=dtype)
    cast = [cast_safetensors(v, dtype) for v in versions]
    sizes, pubs, loads, dens = [], [], [], []
    for v, blob in enumerate(versions):
        pubs.append(pub.publish(v, blob))
        sizes.append(pub.last_weights_bytes)
        t0 = time.perf_counter()
        load_state_dict(store, v)
        loads.append(time.perf_counter() - t0)
        if load_weights_bytes(store, v) != cast[v]:
            raise AssertionError(f"{dtype} v{v}: the rebuilt version differs from the published bytes")
        if v:
            dens.append(density(cast[v - 1], cast[v]))
    full = len(cast[0])
    deltas = sizes[1:]
    return {
        "dtype": dtype,
        "full_mb": round(full / 2**20, 1),
        "delta_mb_median": round(statistics.median(deltas) / 2**20, 2),
        "delta_frac_max": round(max(deltas) / full, 4),
        "density_median": round(statistics.median(dens), 4),
        "publish_s": round(statistics.median(pubs[1:]), 3),
        "load_s": round(statistics.median(loads[1:]), 3),
        "bit_exact": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", type=float, nargs="*", default=[1e-6, 1e-5, 1e-4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--s3", action="store_true")
    a = ap.parse_args()
    import torch

    from areal_core import pretrained
    from benchmarks.weight_transfer import pretrained_chain

    torch.set_num_threads(2)
    path = str(pretrained.ensure("smollm2"))
    server = start_moto("density") if a.s3 else None
    rows = []
    try:
        for lr in a.lrs:
            _, versions = pretrained_chain(path, lr, a.steps, 1, a.batch, seed=0)
            for where in ["local"] + (["s3"] if server else []):
                for dtype in ("float32", "bfloat16"):
                    with tempfile.TemporaryDirectory() as tmp:
                        uri = f"{tmp}/run" if where == "local" else f"{server[1]}/{uuid.uuid4().hex[:8]}"
                        row = {"lr": lr, "store": where, **measure(Store(uri), versions, dtype)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if server:
            server[0].terminate()
    print(
        "| lr | store | dtype | full file MB | delta MB (median) | largest delta / full | elements changed | "
        "publish s | load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['lr']:g} | {r['store']} | {r['dtype']} | {r['full_mb']} | {r['delta_mb_median']} | "
            f"{r['delta_frac_max']:.2%} | {r['density_median']:.2%} | {r['publish_s']} | {r['load_s']} |"
        )


if __name__ == "__main__":
    main()
