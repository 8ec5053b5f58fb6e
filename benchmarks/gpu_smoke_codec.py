"""gpu_smoke's delta_codec section (issue 57): the delta codec's format 3 with its compare and
compaction on the device (areal_core/weights/delta_torch.py) beside a device-to-device copy of
the same bytes, on a bf16 tensor with 4% of its elements moved by one ulp. GB/s are of the bf16
tensor's bytes; each figure is the best of 5 synchronised calls. `tiny` (the CPU fallback): 4 MiB.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from areal_core.weights.delta_torch import apply_words_torch, encode_words_torch


def _best_s(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def delta_codec(device: str, tiny: bool, frac: float = 0.04) -> dict:
    mib = 4 if tiny else 1024
    n = (mib << 20) // 2
    gen = torch.Generator(device=device).manual_seed(0)
    old = torch.randn(n, generator=gen, device=device).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    moved = torch.randperm(n, generator=gen, device=device)[: int(frac * n)]
    new[moved] += 1
    a, b = old.view(torch.uint8), new.view(torch.uint8)
    payload, words, lanes = encode_words_torch(a, b, 2)
    raw = torch.from_numpy(payload).to(device)
    out = a.clone()
    apply_words_torch(out, raw, 2, words, lanes)
    if not torch.equal(out, b):
        raise AssertionError("the device codec's round trip differs")
    copy_s = _best_s(lambda: out.copy_(b), device)
    encode_s = _best_s(lambda: encode_words_torch(a, b, 2), device)
    apply_s = _best_s(lambda: apply_words_torch(out.copy_(a), raw, 2, words, lanes), device)
    gbps = {
        k: round(a.numel() / s / 1e9, 2) for k, s in (("copy", copy_s), ("encode", encode_s), ("copy_apply", apply_s))
    }
    return {
        "mib": mib,
        "changed": lanes,
        "payload_mb": round(payload.size / 2**20, 2),
        "gbps": gbps,
        "of_copy": {k: round(v / gbps["copy"], 3) for k, v in gbps.items()},
        "bytes_per_element_payload": round(payload.size / n, 4),
        "note": "encode includes the payload's copy to the host (not its zstd); copy_apply includes a device copy",
    }
