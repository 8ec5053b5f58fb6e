"""Format 3 of the delta codec (delta_words.py) with torch ops, for data already on a device: the
compare and the compaction run where the tensors are (a GPU: issue 57), and only the small payload
comes back to the host to be compressed. The payload is byte for byte the one encode_words makes,
so delta.py's decoder reads it; apply_words_torch applies one in place on the device.

torch has no packbits: bits are packed as sum(bit_i << i) over groups of 8 (little bit order).
"""

from __future__ import annotations

import numpy as np
import torch

from areal_core.weights.delta_words import sizes

_LANE_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """numpy's packbits(mask, bitorder="little") for a 1-D bool tensor: uint8, ceil(n / 8) bytes."""
    pad = -mask.numel() % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def _unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """numpy's unpackbits(packed, count=count, bitorder="little").view(bool) for a uint8 tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()


def _planes(values: torch.Tensor) -> torch.Tensor:
    """Byte k of every value together (byte plane k), planes in order: uint8."""
    return values.view(torch.uint8).view(-1, values.element_size()).t().reshape(-1)


def encode_words_torch(a: torch.Tensor, b: torch.Tensor, width: int) -> tuple[np.ndarray, int, int] | None:
    """delta_words.encode_words for two uint8 tensors of the data (equal sizes, any device): the
    same (payload, words changed, lanes changed), the payload a host numpy array."""
    nbytes, nw = a.numel(), a.numel() // 8
    x = torch.zeros(0, dtype=torch.int64, device=a.device)  # torch views no empty tensor as int64
    if nw:
        x = a[: nw * 8].view(torch.int64) ^ b[: nw * 8].view(torch.int64)
    changed_words = x != 0
    words = x[changed_words]
    lanes = words.view(_LANE_DTYPE[width])
    changed_lanes = lanes != 0
    values = lanes[changed_lanes]
    n_bits, n_lanes, n_values, n_tail = sizes(nbytes, width, words.numel(), values.numel())
    if n_bits + n_lanes + n_values + n_tail > nbytes:
        return None
    pieces = [_packbits(changed_words)]
    if n_lanes:
        pieces.append(_packbits(changed_lanes))
    pieces += [_planes(values), a[nw * 8 :] ^ b[nw * 8 :]]
    return torch.cat(pieces).cpu().numpy(), words.numel(), values.numel()


def apply_words_torch(
    data: torch.Tensor, raw: torch.Tensor, width: int, words_changed: int, lanes_changed: int
) -> None:
    """delta_words.apply_words on the device: XOR an inflated format 3 payload `raw` (uint8, on
    data's device) into `data` (the uint8 data after the header) in place; ValueError where its
    bitmaps do not match the counts."""
    nbytes, nw, lanes = data.numel(), data.numel() // 8, 8 // width
    n_bits, n_lanes, n_values, _ = sizes(nbytes, width, words_changed, lanes_changed)
    if raw.numel() != sum(sizes(nbytes, width, words_changed, lanes_changed)):
        raise ValueError(
            f"delta holds {raw.numel()} bytes, expected {sum(sizes(nbytes, width, words_changed, lanes_changed))}"
        )
    words = torch.nonzero(_unpackbits(raw[:n_bits], nw)).view(-1)
    if words.numel() != words_changed:
        raise ValueError(f"the delta's word bitmap does not name {words_changed} changed words")
    planes = raw[n_bits + n_lanes : n_bits + n_lanes + n_values].view(width, lanes_changed)
    values = torch.empty(lanes_changed * width, dtype=torch.uint8, device=data.device)
    values.view(lanes_changed, width).copy_(planes.t())
    values = values.view(_LANE_DTYPE[width])
    if lanes > 1:
        lane_mask = _unpackbits(raw[n_bits : n_bits + n_lanes], words_changed * lanes)
        if int(lane_mask.sum()) != lanes_changed:
            raise ValueError(f"the delta's lane bitmap does not name {lanes_changed} changed elements")
        spread = torch.zeros(words_changed * lanes, dtype=values.dtype, device=data.device)
        spread[lane_mask] = values
        values = spread
    if words_changed:
        data64 = data[: nw * 8].view(torch.int64)
        data64[words] ^= values.view(torch.int64)
    data[nw * 8 :] ^= raw[n_bits + n_lanes + n_values :]
