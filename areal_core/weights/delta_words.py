"""Format 3 of the delta codec (issue 57): the changed 8-byte words, a bitmap of them, and in each
one only the lanes (elements) that changed.

The data (after the safetensors header) is read as little-endian 64-bit words; an element of width
W bytes is a lane of a word (L = 8 // W lanes a word, lane l = bits [8 W l, 8 W (l + 1)) of the word).
For two versions a and b, with x = a ^ b word by word and nw = nbytes // 8:

    word bits  = bit i (little bit order) set where x[i] != 0          ceil(nw / 8) bytes
    lane bits  = L bits a changed word, in order, bit l set where its lane l != 0
                                                                        ceil(k L / 8) bytes (none if L == 1)
    values     = the c nonzero lanes in order, as byte planes: byte j of every value together,
                 plane 0 (low bytes) first                              c W bytes
    tail       = the XOR of the last nbytes % 8 bytes

concatenated in that order (padding bits zero) and compressed as one frame (delta.py). Encoding is one
fused pass over the words (numba, delta_kernels.py) on a thread per core: each thread's range writes its word
bits in place and its lane bits and planes into buffers of its own, which are then placed at their
offsets. Decoding checks every count against the manifest first, then walks the word bitmap and
XORs each changed word's lanes in place, again a thread per core.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK_WORDS = 1 << 16  # words between an encoding thread's checks that its output still fits the data
MIN_WORDS_PER_THREAD = 1 << 20  # smaller inputs run on one thread
U64 = np.dtype("<u8")


def word_split(words: int) -> list[int]:
    """Thread boundaries over `words` words: multiples of 8 (a whole bitmap byte each), one part a
    core, none under MIN_WORDS_PER_THREAD words."""
    parts = max(1, min(len(os.sched_getaffinity(0)), words // MIN_WORDS_PER_THREAD))
    return [0] + [words * p // parts >> 3 << 3 for p in range(1, parts)] + [words]


def run_each(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """[fn(item) for item in items], on a thread each when there are several (the kernels let go of
    the GIL)."""
    if len(items) == 1:
        return [fn(items[0])]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def sizes(nbytes: int, width: int, words_changed: int, lanes_changed: int) -> tuple[int, int, int, int]:
    """Byte sizes of (word bits, lane bits, values, tail) of a format 3 payload:
    ceil(nw / 8), ceil(k * L / 8) (0 when L == 1), c * W and nbytes - 8 * nw, with nw = nbytes // 8."""
    lanes = 8 // width
    return (
        (nbytes // 8 + 7) // 8,
        (words_changed * lanes + 7) // 8 if lanes > 1 else 0,
        lanes_changed * width,
        nbytes % 8,
    )


def encode_words(a: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, int, int] | None:
    """(payload, words changed, lanes changed) of format 3 from `a` to `b` (uint8 arrays of the data,
    equal sizes); None when the payload would exceed the data (format 1 is smaller then)."""
    from areal_core.weights import delta_kernels  # numba (~0.3 s to import) only once a delta is made

    nbytes, nw, lanes = a.size, a.size // 8, 8 // width
    a64, b64 = a[: nw * 8].view(U64), b[: nw * 8].view(U64)
    bits = np.empty((nw + 7) // 8, np.uint8)
    bounds = word_split(nw)
    budget = nbytes - bits.size
    chunk, lane_type = max(64, CHUNK_WORDS >> 6 << 6), np.empty(0, f"<u{width}")

    def one(span: tuple[int, int]) -> tuple[int, int, np.ndarray, np.ndarray]:
        lo, hi = span  # buffers for the worst case: only the pages written are ever touched
        lane_bits = np.zeros(((hi - lo) * lanes + 7) // 8, np.uint8)
        planes = np.empty((width, (hi - lo) * lanes), np.uint8)
        words, count = delta_kernels.encode_range(a64, b64, lo, hi, bits, lane_bits, planes, budget, chunk, lane_type)
        return words, count, lane_bits, planes

    parts = run_each(one, list(zip(bounds[:-1], bounds[1:], strict=True)))
    if any(part[0] < 0 for part in parts):
        return None
    words, count = sum(part[0] for part in parts), sum(part[1] for part in parts)
    n_bits, n_lanes, n_values, n_tail = sizes(nbytes, width, words, count)
    total = n_bits + n_lanes + n_values + n_tail
    if total > nbytes:
        return None
    payload = np.empty(total, np.uint8)
    payload[:n_bits] = bits
    lane_out, value_out = payload[n_bits : n_bits + n_lanes], payload[n_bits + n_lanes : total - n_tail]
    lane_out[:] = 0
    planes = value_out.reshape(width, count)
    at_word = at_value = 0
    for part_words, part_count, lane_bits, part_planes in parts:
        if lanes > 1:
            delta_kernels.or_bits(lane_out, at_word * lanes, lane_bits, part_words * lanes)
        planes[:, at_value : at_value + part_count] = part_planes[:, :part_count]
        at_word, at_value = at_word + part_words, at_value + part_count
    np.bitwise_xor(a[nw * 8 :], b[nw * 8 :], out=payload[total - n_tail :])
    return payload, words, count


def unplanes(raw: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` values of `dtype` from their byte planes in `raw` (byte j of every value together,
    planes in order; format 2)."""
    values = np.empty(count, dtype)
    out, width = values.view(np.uint8), dtype.itemsize
    for k in range(width):
        out[k::width] = raw[k * count : (k + 1) * count]
    return values


def _ones(bitmap: np.ndarray, nbits: int) -> int:
    """How many of the first `nbits` bits of a little-order bitmap are set."""
    whole = int(np.bitwise_count(bitmap[: nbits >> 3]).sum(dtype=np.int64))
    if nbits & 7:
        whole += int(np.bitwise_count(bitmap[nbits >> 3] & ((1 << (nbits & 7)) - 1)))
    return whole


def apply_words(data: np.ndarray, raw: np.ndarray, width: int, words_changed: int, lanes_changed: int) -> None:
    """XOR an inflated format 3 payload `raw` into `data` (the uint8 data after the header, in
    place); ValueError where its size or its bitmaps do not match the counts the manifest gives,
    before anything is written."""
    from areal_core.weights import delta_kernels  # numba (~0.3 s to import) only once a delta is read

    nbytes, nw, lanes = data.size, data.size // 8, 8 // width
    if width not in (1, 2, 4, 8) or not (
        0 <= words_changed <= nw and words_changed <= lanes_changed <= words_changed * lanes
    ):
        raise ValueError(f"a delta of {words_changed} words and {lanes_changed} elements does not fit {nw} words")
    n_bits, n_lanes, n_values, n_tail = sizes(nbytes, width, words_changed, lanes_changed)
    if raw.size != n_bits + n_lanes + n_values + n_tail:
        raise ValueError(f"delta holds {raw.size} bytes, expected {n_bits + n_lanes + n_values + n_tail}")
    bits, lane_bits = raw[:n_bits], raw[n_bits : n_bits + n_lanes]
    if _ones(bits, nw) != words_changed:
        raise ValueError(f"the delta's word bitmap does not name {words_changed} changed words")
    if lanes > 1 and _ones(lane_bits, words_changed * lanes) != lanes_changed:
        raise ValueError(f"the delta's lane bitmap does not name {lanes_changed} changed elements")
    planes = raw[n_bits + n_lanes : n_bits + n_lanes + n_values].reshape(width, lanes_changed)
    bounds = word_split(nw)
    firsts = [_ones(bits, lo) for lo in bounds[:-1]]
    first_values = firsts if lanes == 1 else [_ones(lane_bits, f * lanes) for f in firsts]
    data64 = data[: nw * 8].view(U64)
    parts = list(zip(bounds[:-1], bounds[1:], firsts, first_values, strict=True))
    lane_type = np.empty(0, f"<u{width}")
    run_each(lambda part: delta_kernels.apply_range(data64, bits, lane_bits, planes, *part, lane_type), parts)
    data[nw * 8 :] ^= raw[n_bits + n_lanes + n_values :]
