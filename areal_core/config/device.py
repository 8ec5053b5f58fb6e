"""The one list of devices a run, a cluster config and an image can name."""

from __future__ import annotations

from typing import Literal, get_args

Device = Literal["cpu", "cuda", "npu"]  # npu: Ascend (torch_npu)
DEVICES: tuple[Device, ...] = get_args(Device)
