"""The torch form of the delta codec's format 3 (areal_core/weights/delta_torch.py: compare and
compact on the device, issue 57), run here on the CPU: the payload is byte for byte the numpy
encoder's, it applies in place, and corrupt bitmaps are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_core.weights.delta_torch import apply_words_torch, encode_words_torch
from areal_core.weights.delta_words import apply_words, encode_words
from tests.test_weight_delta import changed_bits


@pytest.mark.parametrize("n", [1, 3, 37, 4099])
@pytest.mark.parametrize("frac", [0.0, 0.04, 1.0])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_the_torch_payload_is_the_numpy_payload_and_applies_in_place(n, frac, width):
    old_bits, new_bits = changed_bits(n * 4, frac, seed=n)
    size = (n * 8 - 5) // width * width  # a tail of 1-7 bytes after the whole words, where it fits
    a, b = old_bits.view(np.uint8)[:size], new_bits.view(np.uint8)[:size]
    want = encode_words(a, b, width)
    got = encode_words_torch(torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), width)
    assert (want is None) == (got is None)
    assert (got is None) == (frac == 1.0 and width > 1 and size >= 8)  # denser than the data: format 1
    if got is None:
        return
    assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
    data = torch.from_numpy(a.copy())
    apply_words_torch(data, torch.from_numpy(got[0]), width, got[1], got[2])
    assert np.array_equal(data.numpy(), b)
    host = a.copy()
    apply_words(host, got[0], width, got[1], got[2])
    assert np.array_equal(host, b)


def test_the_torch_decoder_refuses_a_payload_that_does_not_match_its_counts():
    old_bits, new_bits = changed_bits(1000, 0.04, seed=3)
    a, b = old_bits.view(np.uint8), new_bits.view(np.uint8)
    raw, words, lanes = encode_words(a, b, 2)
    data = torch.from_numpy(a.copy())
    with pytest.raises(ValueError, match="holds 130 bytes"):
        apply_words_torch(data, torch.from_numpy(raw[:-1].copy()), 2, words, lanes)
    with pytest.raises(ValueError, match="word bitmap"):
        apply_words_torch(data, torch.from_numpy(raw.copy()), 2, words - 1, lanes)
    bad = raw.copy()
    bad[32] ^= 1  # one lane flipped
    with pytest.raises(ValueError, match="lane bitmap"):
        apply_words_torch(data, torch.from_numpy(bad), 2, words, lanes)
    assert np.array_equal(data.numpy(), a)  # refused before anything was written


def test_gpu_smokes_delta_codec_section_runs_on_the_cpu():
    from benchmarks.gpu_smoke_codec import delta_codec

    figures = delta_codec("cpu", tiny=True)
    assert figures["mib"] == 4 and figures["changed"] == int(0.04 * (4 << 19))
    assert all(figures["gbps"][k] > 0 for k in ("copy", "encode", "copy_apply"))
