"""The numba kernels of the delta codec's format 3 (delta_words.py states the format): compiled on
first use (about 2 s for width 2) and cached in __pycache__; every one lets go of the GIL, so
delta_words runs one a thread per core. numba checks no index: each kernel's docstring gives the
sizes its caller must have checked.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import overload


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
def encode_range(a64, b64, lo, hi, bits, lane_bits, planes, budget, chunk, lane_type):  # noqa: ANN001, ANN202
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
def or_bits(dst, at, src, nbits):  # noqa: ANN001, ANN202
    """OR the first `nbits` bits of `src` into `dst` from bit `at` on (little bit order; the bits of
    src past nbits are zero, dst's are zero there). Sizes: src >= ceil(nbits / 8),
    dst >= ceil((at + nbits) / 8)."""
    base, shift = at >> 3, at & 7
    for i in range((nbits + 7) >> 3):
        v = np.uint16(src[i]) << np.uint16(shift)
        dst[base + i] |= np.uint8(v & np.uint16(0xFF))
        if shift and base + i + 1 < dst.size:
            dst[base + i + 1] |= np.uint8(v >> np.uint16(8))


@njit(nogil=True, cache=True)
def apply_range(data64, bits, lane_bits, planes, lo, hi, first_word, first_value, lane_type):  # noqa: ANN001, ANN202
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
