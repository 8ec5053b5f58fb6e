"""Device abstraction: cpu, cuda and npu (Ascend). `torch_npu` is imported only for npu.

dev = resolve_device("cuda")      # torch.device("cuda:0"); a clear error when unavailable
synchronize(dev)                  # before reading a wall clock in benchmarks
"""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda", "npu")


class DeviceError(RuntimeError):
    """The configured device is unknown or not available on this machine."""


def resolve_device(name: str | torch.device, index: int = 0) -> torch.device:
    """torch.device for "cpu" | "cuda" | "npu" (optionally "cuda:1"); imports torch_npu for npu."""
    if isinstance(name, torch.device):
        return name
    kind, _, idx = str(name).partition(":")
    if kind not in DEVICES:
        raise DeviceError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401 - registers the npu backend with torch
        except ImportError as exc:
            raise DeviceError("device 'npu' needs torch_npu (the ascend image)") from exc
    module = getattr(torch, kind, None)
    if module is None or not module.is_available():
        raise DeviceError(f"device {kind!r} is not available on this machine")
    return torch.device(f"{kind}:{int(idx) if idx else index}")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on `device` (a no-op on cpu)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
