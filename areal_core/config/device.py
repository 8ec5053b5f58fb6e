"""The one list of devices a run, a cluster config and an image can name."""

from __future__ import annotations

from typing import Literal, get_args

Device = Literal["cpu", "cuda", "npu"]  # npu: Ascend (torch_npu)
DEVICES: tuple[Device, ...] = get_args(Device)

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU features that make bf16 matmuls native, not emulated


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fast_bf16(device: str, flags: set[str] | None = None) -> bool:
    """Whether bf16 is faster than fp32 on `device`: always on an accelerator; on a CPU only with
    avx512_bf16 or AMX (an AVX2-only CPU emulates bf16 matmuls, many times slower than fp32)."""
    if device != "cpu":
        return True
    return bool(set(BF16_CPU_FLAGS) & (cpu_flags() if flags is None else flags))


def use_bf16(choice: bool | str, device: str, flags: set[str] | None = None) -> bool:
    """A bf16 choice of the config (True, False, or "auto": `fast_bf16` decides) for this machine."""
    return fast_bf16(device, flags) if choice == "auto" else bool(choice)
