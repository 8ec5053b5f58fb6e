"""Format 3 of the delta codec (issue 57): the changed 8-byte words, a bitmap of them, and in each
one only the lanes (elements) that changed.

The data (after the safetensors header) is read as little-endian 64-bit words; an element of width
W bytes is a lane of a word (L = 8 // W lanes a word). For two versions a and b:

    x = a ^ b                       word by word, in chunks that stay in cache, over every core
    word bits  = packbits(x != 0)   one bit a word (little bit order), nw bits
    lane bits  = packbits(lanes of x[x != 0] != 0)   L bits a changed word (absent when L == 1)
    values     = the nonzero lanes of x[x != 0], as byte planes (byte k of every value together)
    tail       = the XOR of the last nbytes % 8 bytes

concatenated in that order and compressed as one frame. Decoding XORs the values back into the
words the bitmaps name, in place. Only elementwise numpy compares, packbits, flatnonzero on the
word mask (a quarter of the bf16 elements) and gathers of the changed words: no Python loop over
elements. Every size is checked against the data before anything inflates; a frame never inflates
past the size it must have (at most the data's size).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK_WORDS = 1 << 14  # words per pass: 128 KiB of each input and of their XOR stay in L2
MIN_WORDS_PER_THREAD = 1 << 20  # smaller inputs run on one thread
U64 = np.dtype("<u8")


def word_split(words: int) -> list[int]:
    """Thread boundaries over `words` words: multiples of 8 (a whole bitmap byte each), one part a
    core, none under MIN_WORDS_PER_THREAD words."""
    parts = max(1, min(os.cpu_count() or 1, words // MIN_WORDS_PER_THREAD))
    return [0] + [words * p // parts >> 3 << 3 for p in range(1, parts)] + [words]


def run_each(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """[fn(item) for item in items], on a thread each when there are several (numpy lets go of the
    GIL in its loops)."""
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


def _changed_in(
    a64: np.ndarray, b64: np.ndarray, bits: np.ndarray, width: int, lo: int, hi: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """Over the words in [lo, hi) (lo a multiple of 8): their bits set in `bits` where a64 and b64
    differ (one bit a word, little bit order); (how many differ, which lanes of those words differ
    (L bools a word), the XOR of those lanes)."""
    size = min(CHUNK_WORDS, hi - lo)
    x, mask, found = np.empty(size, U64), np.empty(size, bool), []
    for i in range(lo, hi, CHUNK_WORDS):
        j = min(i + CHUNK_WORDS, hi)
        xs, ms = x[: j - i], mask[: j - i]
        np.bitwise_xor(a64[i:j], b64[i:j], out=xs)
        np.not_equal(xs, 0, out=ms)
        bits[i >> 3 : (j + 7) >> 3] = np.packbits(ms, bitorder="little")
        found.append(np.compress(ms, xs))
    words = np.concatenate(found) if found else np.empty(0, U64)
    lanes = words.view(f"<u{width}")
    changed = np.not_equal(lanes, 0)
    return words.size, changed, np.compress(changed, lanes)


def encode_words(a: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, int, int] | None:
    """(payload, words changed, lanes changed) of format 3 from `a` to `b` (uint8 arrays of the data,
    equal sizes); None when the payload would exceed the data (format 1 is smaller then)."""
    nbytes, nw = a.size, a.size // 8
    a64, b64 = a[: nw * 8].view(U64), b[: nw * 8].view(U64)
    bits = np.empty((nw + 7) // 8, np.uint8)
    bounds = word_split(nw)
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    parts = run_each(lambda span: _changed_in(a64, b64, bits, width, *span), spans)
    words = sum(part[0] for part in parts)
    values = np.concatenate([part[2] for part in parts])
    n_bits, n_lanes, n_values, n_tail = sizes(nbytes, width, words, values.size)
    total = n_bits + n_lanes + n_values + n_tail
    if total > nbytes:
        return None
    payload = np.empty(total, np.uint8)
    payload[:n_bits] = bits
    if n_lanes:
        payload[n_bits : n_bits + n_lanes] = np.packbits(np.concatenate([part[1] for part in parts]), bitorder="little")
    planes_into(payload[n_bits + n_lanes : total - n_tail], values)
    np.bitwise_xor(a[nw * 8 :], b[nw * 8 :], out=payload[total - n_tail :])
    return payload, words, values.size


def planes_into(out: np.ndarray, values: np.ndarray) -> None:
    """Byte k of every value together (byte plane k), planes in order, written into `out`."""
    raw, n, width = values.view(np.uint8), values.size, values.itemsize
    for k in range(width):  # one strided copy a plane
        out[k * n : (k + 1) * n] = raw[k::width]


def unplanes(raw: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    """Inverse of `planes_into`: `count` values of `dtype` from their byte planes in `raw`."""
    values = np.empty(count, dtype)
    out, width = values.view(np.uint8), dtype.itemsize
    for k in range(width):
        out[k::width] = raw[k * count : (k + 1) * count]
    return values


def _xor_in(
    data64: np.ndarray, bits: np.ndarray, lane_mask: np.ndarray | None, values: np.ndarray, part: tuple[int, ...]
) -> None:
    """XOR into data64's words in [lo, hi) whose bit is set their lanes' values: word `first_word`
    on of the changed ones, value `first_value` on; lane_mask (L bools a changed word) says which
    lanes have a value (None: one lane a word, every one)."""
    lo, hi, first_word, first_value = part
    words = np.flatnonzero(np.unpackbits(bits[lo >> 3 : (hi + 7) >> 3], count=hi - lo, bitorder="little").view(bool))
    words += lo
    if lane_mask is None:
        xors = values[first_word : first_word + words.size]
    else:
        lanes = 8 // values.itemsize
        where = np.flatnonzero(lane_mask[first_word * lanes : (first_word + words.size) * lanes])
        spread = np.zeros(words.size * lanes, values.dtype)
        spread[where] = values[first_value : first_value + where.size]
        xors = spread.view(U64)
    data64[words] ^= xors


def apply_words(data: np.ndarray, raw: np.ndarray, width: int, words_changed: int, lanes_changed: int) -> None:
    """XOR an inflated format 3 payload `raw` into `data` (the uint8 data after the header, in
    place); ValueError where its bitmaps do not match the counts the manifest gives."""
    nbytes, nw, lanes = data.size, data.size // 8, 8 // width
    n_bits, n_lanes, n_values, _ = sizes(nbytes, width, words_changed, lanes_changed)
    bits = raw[:n_bits]
    last = np.unpackbits(bits[nw >> 3 :], count=nw & 7, bitorder="little")
    if int(np.bitwise_count(bits[: nw >> 3]).sum()) + int(np.count_nonzero(last)) != words_changed:
        raise ValueError(f"the delta's word bitmap does not name {words_changed} changed words")
    values = unplanes(raw[n_bits + n_lanes : n_bits + n_lanes + n_values], np.dtype(f"<u{width}"), lanes_changed)
    lane_mask = None
    if lanes > 1:
        lane_mask = np.unpackbits(raw[n_bits : n_bits + n_lanes], count=words_changed * lanes, bitorder="little")
        lane_mask = lane_mask.view(bool)
        if int(np.count_nonzero(lane_mask)) != lanes_changed:
            raise ValueError(f"the delta's lane bitmap does not name {lanes_changed} changed elements")
    bounds = word_split(nw)
    firsts = [int(np.bitwise_count(bits[: lo >> 3]).sum()) for lo in bounds[:-1]]
    first_values = firsts if lane_mask is None else [int(np.count_nonzero(lane_mask[: f * lanes])) for f in firsts]
    data64 = data[: nw * 8].view(U64)
    parts = list(zip(bounds[:-1], bounds[1:], firsts, first_values, strict=True))
    run_each(lambda part: _xor_in(data64, bits, lane_mask, values, part), parts)
    data[nw * 8 :] ^= raw[n_bits + n_lanes + n_values :]
