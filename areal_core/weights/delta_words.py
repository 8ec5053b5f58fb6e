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
fused pass over the words (numba, no GIL) on a thread per core: each thread's range writes its word
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
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import overload

CHUNK_WORDS = 1 << 16  # words between an encoding thread's checks that its output still fits the data
MIN_WORDS_PER_THREAD = 1 << 20  # smaller inputs run on one thread
U64 = np.dtype("<u8")


def word_split(words: int) -> list[int]:
    """Thread boundaries over `words` words: multiples of 8 (a whole bitmap byte each), one part a
    core, none under MIN_WORDS_PER_THREAD words."""
    parts = max(1, min(os.cpu_count() or 1, words // MIN_WORDS_PER_THREAD))
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


def lane_width(lane_type: np.ndarray) -> int:
    """W, the byte width of lane_type's dtype; in a kernel a constant of its type (so the lane loops unroll)."""
    return lane_type.itemsize


@overload(lane_width)
def _lane_width(lane_type):  # noqa: ANN001, ANN202
    width = lane_type.dtype.bitwidth // 8
    return lambda lane_type: width


@njit(nogil=True, cache=True)
def _block_bits(a64, b64, i, n, bits):  # noqa: ANN001, ANN202
    """The mask of words i .. i + n - 1 (i a multiple of 8, n <= 64) where a64 and b64 differ (bit j
    for word i + j), also written as bitmap bytes bits[i >> 3:]."""
    block = np.uint64(0)
    if n == 64:
        for t in range(8):
            byte = np.uint64(0)
            for j in range(8):
                byte |= np.uint64(a64[i + 8 * t + j] != b64[i + 8 * t + j]) << np.uint64(j)
            bits[(i >> 3) + t] = np.uint8(byte)
            block |= byte << np.uint64(8 * t)
        return block
    for j in range(n):
        block |= np.uint64(a64[i + j] != b64[i + j]) << np.uint64(j)
    for t in range((n + 7) >> 3):
        bits[(i >> 3) + t] = np.uint8((block >> np.uint64(8 * t)) & np.uint64(0xFF))
    return block


@njit(nogil=True, cache=True)
def _nonzero_lanes(x, width):  # noqa: ANN001, ANN202
    """Bit l set where lane l (bits [8 W l, 8 W (l + 1))) of the word x is nonzero: a lane's top bit
    is set in ((x & ~H) + ~H) | x, H the lanes' top bits (no carry crosses a lane)."""
    top = np.uint64(0)
    for lane in range(8 // width):
        top |= np.uint64(1) << np.uint64(8 * width * (lane + 1) - 1)
    seen = (((x & ~top) + ~top) | x) & top
    m = 0
    for lane in range(8 // width):
        m |= np.int64((seen >> np.uint64(8 * width * (lane + 1) - 1)) & np.uint64(1)) << lane
    return m


@njit(nogil=True, cache=True)
def _encode_range(a64, b64, lo, hi, bits, lane_bits, planes, budget, chunk, lane_type):  # noqa: ANN001, ANN202
    """Words [lo, hi) (lo a multiple of 8) of a64 ^ b64: their bits into bits[lo >> 3:]; the lane
    bits of the changed ones ORed into lane_bits (zeroed) from bit 0; their nonzero lanes' bytes
    into the rows of `planes` (W rows, row k byte k of the value) from column 0, W the width of
    lane_type's dtype. Returns (changed words, lanes), or (-1, -1) once the lane bits and values
    alone pass `budget` bytes (checked every `chunk` words, a multiple of 64). Sizes:
    bits >= ceil(hi / 8), lane_bits >= ceil((hi - lo) L / 8), planes (W, >= (hi - lo) L).
    64 words at a time: their mask, then its set bits lowest first, and in each such word the set
    bits of its nonzero lanes' mask."""
    width = lane_width(lane_type)
    lanes = 8 // width
    lane_mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    words = count = 0
    for start in range(lo, hi, chunk):
        for i in range(start, min(start + chunk, hi), 64):
            block = _block_bits(a64, b64, i, min(64, hi - i), bits)
            while block:
                x = a64[i + trailing_zeros(block)] ^ b64[i + trailing_zeros(block)]
                block &= block - np.uint64(1)
                m = _nonzero_lanes(x, width)
                if lanes > 1:
                    lane_bits[(words * lanes) >> 3] |= np.uint8(m << ((words * lanes) & 7))
                while m:  # mostly one lane
                    v = (x >> np.uint64(8 * width * trailing_zeros(m))) & lane_mask
                    m &= m - 1
                    for k in range(width):
                        planes[k, count] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))
                    count += 1
                words += 1
        if (words * lanes + 7) // 8 + count * width > budget:
            return -1, -1
    return words, count


@njit(nogil=True, cache=True)
def _or_bits(dst, at, src, nbits):  # noqa: ANN001, ANN202
    """OR the first `nbits` bits of `src` into `dst` from bit `at` on (little bit order; the bits of
    src past nbits are zero, dst's are zero there). Sizes: src >= ceil(nbits / 8),
    dst >= ceil((at + nbits) / 8)."""
    base, shift = at >> 3, at & 7
    for i in range((nbits + 7) >> 3):
        v = np.uint16(src[i]) << np.uint16(shift)
        dst[base + i] |= np.uint8(v & np.uint16(0xFF))
        if shift and base + i + 1 < dst.size:
            dst[base + i + 1] |= np.uint8(v >> np.uint16(8))


def encode_words(a: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, int, int] | None:
    """(payload, words changed, lanes changed) of format 3 from `a` to `b` (uint8 arrays of the data,
    equal sizes); None when the payload would exceed the data (format 1 is smaller then)."""
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
        words, count = _encode_range(a64, b64, lo, hi, bits, lane_bits, planes, budget, chunk, lane_type)
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
            _or_bits(lane_out, at_word * lanes, lane_bits, part_words * lanes)
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


@njit(nogil=True, cache=True)
def _apply_range(data64, bits, lane_bits, planes, lo, hi, first_word, first_value, lane_type):  # noqa: ANN001, ANN202
    """XOR into data64's words in [lo, hi) (lo a multiple of 8) whose bit is set in `bits` their
    nonzero lanes: the changed words from number `first_word` on, whose lane bits start at bit
    first_word L of lane_bits, and their values from column `first_value` of `planes` (W rows, W
    the width of lane_type's dtype). The caller has checked that the bitmaps name exactly as many
    words and lanes as there are, so no index passes an array. 64 words at a time, their set bits
    lowest first, and in each such word the set bits of its lane field."""
    width = lane_width(lane_type)
    lanes = 8 // width
    lane_field = (1 << lanes) - 1
    word, value = first_word, first_value
    for i in range(lo, hi, 64):
        n = min(64, hi - i)
        block = np.uint64(0)
        for t in range((n + 7) >> 3):
            block |= np.uint64(bits[(i >> 3) + t]) << np.uint64(8 * t)
        if n < 64:
            block &= (np.uint64(1) << np.uint64(n)) - np.uint64(1)  # the bits past the last word name none
        while block:
            j = trailing_zeros(block)
            block &= block - np.uint64(1)
            m = lane_field
            if lanes > 1:
                m = (np.int64(lane_bits[(word * lanes) >> 3]) >> ((word * lanes) & 7)) & lane_field
            x = np.uint64(0)
            while m:  # mostly one lane
                v = np.uint64(0)
                for k in range(width):
                    v |= np.uint64(planes[k, value]) << np.uint64(8 * k)
                x |= v << np.uint64(8 * width * trailing_zeros(m))
                m &= m - 1
                value += 1
            data64[i + j] ^= x
            word += 1


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
    run_each(lambda part: _apply_range(data64, bits, lane_bits, planes, *part, lane_type), parts)
    data[nw * 8 :] ^= raw[n_bits + n_lanes + n_values :]
