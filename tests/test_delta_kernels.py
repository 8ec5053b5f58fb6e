"""The numba kernels of the delta codec's format 3 (areal_core/weights/delta_kernels.py, issue 57)
against a plain numpy statement of the format: the same payload byte for byte at every width, at
sizes that are not multiples of 8 bytes, of 64 words or of the thread split, and hostile payloads
refused (or kept inside the data) before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from areal_core.weights import delta_kernels, delta_words
from areal_core.weights.delta_words import apply_words, encode_words


def reference_payload(a: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, int, int] | None:
    """Format 3 as delta_words' docstring states it, in numpy: word bits, lane bits (L > 1), the
    nonzero lanes' byte planes, the tail; None when that is larger than the data."""
    nw = a.size // 8
    x = a[: nw * 8].view("<u8") ^ b[: nw * 8].view("<u8")
    changed = x != 0
    lanes = x[changed].view(f"<u{width}")
    values = lanes[lanes != 0]
    parts = [np.packbits(changed, bitorder="little")]
    if width < 8:
        parts.append(np.packbits(lanes != 0, bitorder="little"))
    parts += [values.view(np.uint8).reshape(-1, width).T.reshape(-1), a[nw * 8 :] ^ b[nw * 8 :]]
    payload = np.concatenate(parts)
    return None if payload.size > a.size else (payload, int(changed.sum()), int(values.size))


def pair(nbytes: int, width: int, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random data of nbytes and a copy with `frac` of its width-byte elements changed (the last
    nbytes % width bytes, if any, changed at the same rate byte by byte)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    b = a.copy()
    flip = rng.random(nbytes // width) < frac
    b[: nbytes // width * width].reshape(-1, width)[flip, rng.integers(0, width, int(flip.sum()))] ^= 1 + rng.integers(
        0, 255, int(flip.sum()), dtype=np.uint8
    )
    tail = rng.random(nbytes % width) < frac
    b[nbytes // width * width :][tail] ^= 0x80
    return a, b


def round_trip(a: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, int, int] | None:
    """encode_words checked against the reference payload, then applied to a copy of a in place."""
    got, want = encode_words(a, b, width), reference_payload(a, b, width)
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
        data = a.copy()
        apply_words(data, got[0], width, got[1], got[2])
        assert np.array_equal(data, b)
    return got


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [0, 5, 8, 13, 8 * 63 + 7, 8 * 64, 8 * 65 + 3, 8 * 1000 + 1])
@pytest.mark.parametrize("frac", [0.0, 0.04, 0.3])
def test_the_payload_is_the_reference_payload_at_every_width_and_size(width, nbytes, frac):
    nbytes = nbytes // width * width  # a safetensors file's data is whole elements
    a, b = pair(nbytes, width, frac, seed=nbytes * 10 + width)
    got = round_trip(a, b, width)
    if frac == 0.0:
        assert got is not None and got[1:] == (0, 0) and not got[0].any()


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_split_over_threads_at_bounds_that_are_not_multiples_of_64_words(width, monkeypatch):
    monkeypatch.setattr(delta_words, "MIN_WORDS_PER_THREAD", 64)
    monkeypatch.setattr(delta_words, "CHUNK_WORDS", 128)
    monkeypatch.setattr(delta_words.os, "sched_getaffinity", lambda pid: set(range(5)))
    nbytes = 8 * 1003 + 5  # 1003 words in 5 parts: multiples of 8, not of 64
    assert delta_words.word_split(1003) == [0, 200, 400, 600, 800, 1003]
    for seed, frac in enumerate((0.01, 0.1, 0.5)):  # odd changed-word counts: lane bits off byte boundaries
        a, b = pair(nbytes, width, frac, seed=seed)
        round_trip(a, b, width)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_all_words_changed_is_larger_than_the_data_so_none(width):
    a = np.zeros(8 * 100, np.uint8)
    b = np.full(8 * 100, 0xFF, np.uint8)  # every lane of every word: bitmaps + all values > the data
    assert encode_words(a, b, width) is None and reference_payload(a, b, width) is None


def test_the_encoder_stops_once_its_output_passes_the_budget():
    a64 = np.zeros(1024, "<u8")
    b64 = np.full(1024, 0x0101010101010101, "<u8")  # all 4 lanes of every word changed: 8 bytes a word
    bits, lane_bits, planes = np.zeros(128, np.uint8), np.zeros(512, np.uint8), np.zeros((2, 4096), np.uint8)
    lane_type = np.empty(0, "<u2")
    assert delta_kernels.encode_range(a64, b64, 0, 1024, bits, lane_bits, planes, 1 << 20, 64, lane_type) == (
        1024,
        4096,
    )
    assert delta_kernels.encode_range(a64, b64, 0, 1024, bits, lane_bits, planes, 1000, 64, lane_type) == (-1, -1)


def test_unaligned_data_round_trips():
    a, b = pair(8 * 300 + 9, 2, 0.05, seed=7)
    round_trip(a[1:], b[1:], 2)  # the words start one byte off an 8-byte boundary


def encoded(width: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    a, b = pair(8 * 250 + 2, width, 0.04, seed=11)
    payload, words, lanes = encode_words(a, b, width)
    return a, b, payload, words, lanes


def test_payloads_whose_sizes_or_bitmaps_disagree_with_the_counts_are_refused_before_writing():
    a, _, payload, words, lanes = encoded()
    n_bits = (250 + 7) // 8
    cases = [
        (payload[:-1], words, lanes, "holds"),
        (payload, words - 1, lanes, "holds|word bitmap"),
        (payload, 251, 251, "does not fit 250 words"),
        (payload, words, words * 4 + 1, "does not fit 250 words"),
    ]
    word_flipped = payload.copy()
    word_flipped[3] ^= 0x10  # one more or one fewer changed word
    lane_flipped = payload.copy()
    lane_flipped[n_bits] ^= 0x01  # one more or one fewer changed lane
    cases += [(word_flipped, words, lanes, "word bitmap"), (lane_flipped, words, lanes, "lane bitmap")]
    for raw, w, c, message in cases:
        data = a.copy()
        with pytest.raises(ValueError, match=message):
            apply_words(data, raw, 2, w, c)
        assert np.array_equal(data, a)  # untouched


def test_hostile_bitmaps_with_matching_counts_stay_inside_the_data():
    a, b, payload, words, lanes = encoded()
    word_bits = np.unpackbits(payload[:32], count=250, bitorder="little")
    moved = payload.copy()  # the first changed word's bit moved to the last unchanged word: same count
    first, last = int(np.flatnonzero(word_bits)[0]), int(np.flatnonzero(word_bits == 0)[-1])
    moved[first >> 3] ^= 1 << (first & 7)
    moved[last >> 3] |= 1 << (last & 7)
    padding = payload.copy()
    padding[31] |= 0x80  # bit 255 of the word bitmap: past the 250 words, not a word
    guarded = np.full(a.size + 64, 0xA5, np.uint8)
    for raw in (moved, padding):
        guarded[32:-32] = a
        apply_words(guarded[32:-32], raw, 2, words, lanes)  # garbage in, but only in the data
        assert (guarded[:32] == 0xA5).all() and (guarded[-32:] == 0xA5).all()
    assert np.array_equal(guarded[32:-32], b)  # the padding bit was ignored


def test_apply_delta_refuses_a_base_it_cannot_write_in_place_before_reading_the_payload():
    import torch
    from safetensors.torch import save as st_save

    from areal_core.weights.delta import apply_delta, encode_delta

    old = torch.arange(4096, dtype=torch.float32).to(torch.bfloat16)
    new = old.clone()
    new[::7] += 1
    a, b = st_save({"w": old}), st_save({"w": new})
    payload, info = encode_delta(a, b)
    base = np.frombuffer(a, np.uint8)  # read-only: a view of bytes
    for bad in (base, np.frombuffer(a, np.uint8).copy()[::2], np.frombuffer(a, np.uint8).copy().view(np.int8)):
        with pytest.raises(ValueError, match="writable, contiguous 1-D uint8"):
            apply_delta(bad, payload, info)
    assert bytes(base) == a
    dst = base.copy()
    apply_delta(dst, payload, info)
    assert dst.tobytes() == b
