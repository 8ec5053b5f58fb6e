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

    PYTHONPATH=. .venv/bin/python benchmarks/weight_density.py --codec [--mib 256] [--frac 0.04] [--before REV]

--codec (issue 57): the codec alone on a synthetic bf16 file of --mib MiB with --frac of its
elements changed by one ulp: encode and decode GB/s (of the bf16 file's bytes) of
areal_core/weights/delta.py at git revision --before and now, beside a memcpy of the same bytes, all
in one run, by wall time and by the process's CPU time (every thread's: on a shared machine the
steadier figure; per core when the codec's threads add up), best of --repeats each; with the CPU's
model name, the codec's threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from areal_core.store import Store
from areal_core.weights import delta, delta_words
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


def bf16_pair(mib: int, frac: float, seed: int = 0) -> tuple[bytes, bytes]:
    """Two safetensors files of one bf16 tensor of `mib` MiB; `frac` of its elements (random
    positions) moved by ±1 in their bits (one bf16 ulp: the typical change of a small AdamW step)."""
    import torch
    from safetensors.torch import save

    rng = np.random.default_rng(seed)
    n = (mib << 20) // 2
    old = torch.from_numpy(rng.standard_normal(n, np.float32)).to(torch.bfloat16)
    bits = old.view(torch.int16).numpy().copy()
    moved = rng.choice(n, int(frac * n), replace=False)
    bits[moved] += rng.choice(np.array([-1, 1], np.int16), moved.size)
    return save({"w": old}), save({"w": torch.from_numpy(bits).view(torch.bfloat16)})


def codec_at(rev: str) -> Any:
    """areal_core/weights/delta.py as it was at git revision `rev` (our own history), as a module."""
    source = subprocess.run(["git", "show", f"{rev}:areal_core/weights/delta.py"], capture_output=True, check=True)
    module = types.ModuleType(f"delta_{rev}")
    exec(compile(source.stdout, f"delta.py@{rev}", "exec"), module.__dict__)  # noqa: S102 - our git history
    return module


def best_s(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(wall s, process CPU s) of `fn`, each the best of `repeats` calls: on a shared machine the
    CPU seconds (all of the process's threads) are the steadier figure."""
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def codec_speed(mib: int, frac: float, before: str, repeats: int) -> list[dict]:
    """Encode and decode GB/s (of the bf16 file) of the codec before (`before`) and now, beside a
    memcpy of the same bytes: into a buffer already allocated (np.copyto) and into a new bytes
    (what decode_delta must return: Python allocates it on 4 KiB pages)."""
    old, new = bf16_pair(mib, frac)
    src, dst = np.frombuffer(new, np.uint8), np.empty(len(new), np.uint8)
    rows = [
        {"what": "memcpy into an allocated buffer", "s": best_s(lambda: np.copyto(dst, src), repeats)},
        {"what": "memcpy into a new bytes", "s": best_s(src.tobytes, repeats)},
    ]
    for label, codec in ((f"before ({before})", codec_at(before)), ("now", delta)):
        payload, info = codec.encode_delta(old, new, "zstd")
        if codec.decode_delta(old, payload, info) != new:
            raise AssertionError(f"{label}: the decoded file differs")
        enc = best_s(lambda codec=codec: codec.encode_delta(old, new, "zstd"), repeats)
        dec = best_s(lambda codec=codec, p=payload, i=info: codec.decode_delta(old, p, i), repeats)
        rows.append({"what": f"encode, {label}", "s": enc, "delta_mb": len(payload) / 2**20})
        rows.append({"what": f"decode to a new bytes, {label}", "s": dec, "delta_mb": len(payload) / 2**20})
    base = np.frombuffer(old, np.uint8)

    def apply_in_place() -> None:
        np.copyto(dst, base)
        delta.apply_delta(dst, payload, info)

    apply_in_place()
    if dst.tobytes() != new:
        raise AssertionError("apply_delta: the decoded file differs")
    rows.append(
        {"what": "decode into an allocated buffer (copy + apply_delta), now", "s": best_s(apply_in_place, repeats)}
    )
    (memcpy_wall, memcpy_cpu), new_bytes_cpu = rows[0]["s"], rows[1]["s"][1]
    for r in rows:
        wall, cpu = r.pop("s")
        r.update(s=round(wall, 4), cpu_s=round(cpu, 4), gbps=round(len(new) / wall / 1e9, 2))
        r.update(gbps_cpu=round(len(new) / cpu / 1e9, 2), of_memcpy=round(memcpy_wall / wall, 3))
        r.update(of_memcpy_cpu=round(memcpy_cpu / cpu, 3), of_memcpy_new_bytes_cpu=round(new_bytes_cpu / cpu, 3))
    return rows


def codec_main(a: argparse.Namespace) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    head = {"cpu": cpu, "cores": os.cpu_count(), "codec_threads": len(delta_words.word_split(a.mib << 17)) - 1}
    print(json.dumps({**head, "loadavg_before": os.getloadavg()}), flush=True)
    rows = codec_speed(a.mib, a.frac, a.before, a.repeats)
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({"loadavg_after": os.getloadavg()}))
    print(
        f"| {a.mib} MiB bf16, {a.frac:.0%} changed (best of {a.repeats}) | wall s | CPU s | GB/s wall | GB/s CPU | "
        "of memcpy, wall | of memcpy, CPU | of memcpy into new bytes, CPU | delta MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = f"{r['delta_mb']:.2f}" if "delta_mb" in r else ""
        print(
            f"| {r['what']} | {r['s']} | {r['cpu_s']} | {r['gbps']} | {r['gbps_cpu']} | {r['of_memcpy']:.0%} | "
            f"{r['of_memcpy_cpu']:.0%} | {r['of_memcpy_new_bytes_cpu']:.0%} | {mb} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", type=float, nargs="*", default=[1e-6, 1e-5, 1e-4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--codec", action="store_true", help="the codec's speed against memcpy only")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--frac", type=float, default=0.04)
    ap.add_argument("--before", default="041935a", help="git revision of the codec to compare with (format 2)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.codec:
        return codec_main(a)
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
