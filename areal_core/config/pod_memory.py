"""The prepare pod's memory as a function of the checkpoint's size (docs/cluster.md, "The prepare pod's
memory"): RAM = headroom · (a·W + b) for W bytes of float32 weights, with a and b measured by
benchmarks/prepare_memory.py. Plain arithmetic, no torch: the cluster config and the front ends read
it; run/prepare_memory.py holds the one-copy-at-a-time mechanism it was measured on.
"""

from __future__ import annotations

import math

MAX_WEIGHT_BYTES = 2 * 1024**3  # larger checkpoint files are checked without their weights (no agreement check)
# the largest float32 weights prepare loads: MAX_WEIGHT_BYTES of bfloat16 or float16 files, cast to float32
LARGEST_LOADED_WEIGHT_BYTES = 2 * MAX_WEIGHT_BYTES

# RAM ≈ a·W + b, fitted on a 97 MiB Llama and SmolLM2-135M (513 MiB), both stored in float32, LoRA on:
#   rollout.engine=torch, float32:   a 1.21, b 496 MiB
#   rollout.engine=auto, float32:    a 1.54, b 530 MiB (the continuous engine's fused matrices)
#   rollout.engine=auto, bfloat16:   a 1.83, b 546 MiB (the cast copy, its fused matrices)
# a and b are the largest of these, rounded up; before one copy at a time: a 3.84, b 625 MiB.
PREPARE_RAM_PER_WEIGHT_BYTE = 1.9
PREPARE_RAM_BASE_BYTES = 576 * 2**20  # the interpreter, torch, transformers, the task's rows
PREPARE_RAM_HEADROOM = 1.25  # the Flyte entrypoint in the same container, allocator slack


def prepare_memory_bytes(
    weight_bytes: int,
    per_weight_byte: float = PREPARE_RAM_PER_WEIGHT_BYTE,
    base_bytes: int = PREPARE_RAM_BASE_BYTES,
    headroom: float = PREPARE_RAM_HEADROOM,
) -> int:
    """The memory a prepare pod needs for a checkpoint of `weight_bytes` in float32 (4 bytes a
    parameter): headroom · (a · W + b), rounded up to whole MiB. W = 0 for a checkpoint whose files
    exceed MAX_WEIGHT_BYTES (checked on the meta device)."""
    return math.ceil(headroom * (per_weight_byte * weight_bytes + base_bytes) / 2**20) * 2**20


def prepare_pod_memory() -> str:
    """The prepare pod's memory as a Kubernetes quantity: `prepare_memory_bytes` of the largest
    weights prepare loads (LARGEST_LOADED_WEIGHT_BYTES), rounded up to whole GiB."""
    return f"{math.ceil(prepare_memory_bytes(LARGEST_LOADED_WEIGHT_BYTES) / 2**30)}Gi"


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("6Gi", "512Mi", "1G", "1500") in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor)
    return int(float(quantity))
