"""Delta weight publication (areal_core/weights/publisher.py, `train.weight_delta`): bit-exact rebuild
over a chain of real AdamW steps, readers joining mid-chain, refusal of corrupt deltas, prune."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.config import ConfigError, ModelConfig, load_config
from areal_core.layout import LAYOUT
from areal_core.models import build_tiny_model
from areal_core.store import Store
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, WeightsError, delta_words, sha256
from areal_core.weights import delta as delta_module
from areal_core.weights.delta import decode_delta, encode_delta
from areal_core.weights.publisher import WeightPublisher, prune, state_dict_bytes
from areal_core.weights.reader import load_state_dict, load_weights_bytes, stage_verified

SIDE = {"config.json": b'{"a": 1}'}


def adamw_versions(n: int) -> list[bytes]:
    """safetensors bytes of a tiny model after 0..n-1 AdamW steps (lr 1e-4) on a real LM loss."""
    model = build_tiny_model(
        ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64), 50, 0
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    out = [state_dict_bytes(model)]
    for _ in range(n - 1):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        out.append(state_dict_bytes(model))
    return out


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return adamw_versions(10)


def publish_all(store: Store, blobs: list[bytes], full_every: int = 4) -> WeightPublisher:
    pub = WeightPublisher(store, SIDE, delta=True, full_every=full_every)
    for v, blob in enumerate(blobs):
        pub.publish(v, blob)
    return pub


def test_delta_round_trip_is_bit_exact_from_any_starting_point(tmp_path, blobs):
    store = Store(str(tmp_path / "run"))
    sizes = []
    pub = WeightPublisher(store, SIDE, delta=True, full_every=4)
    for v, blob in enumerate(blobs):
        pub.publish(v, blob)
        sizes.append(pub.last_weights_bytes)
    for v in range(10):
        files = store.read_json(LAYOUT.manifest(v))["files"]
        assert (WEIGHTS_FILE in files) == (v % 4 == 0) and (DELTA_FILE in files) == (v % 4 != 0)
        assert set(files) - {WEIGHTS_FILE, DELTA_FILE} == {"config.json"}
    assert all(sizes[v] < 0.9 * len(blobs[v]) for v in range(10) if v % 4)  # the deltas are smaller
    # a reader with nothing cached rebuilds every version from its full snapshot + deltas
    for v, blob in enumerate(blobs):
        assert load_weights_bytes(store, v) == blob
    # the rollout path (load_state_dict): a reader that joins at v6 (mid-chain), then follows
    # from the verified bytes it keeps: v7 needs only v7's delta once v6 is loaded
    assert load_weights_bytes(store, 7, have=(6, blobs[6])) == blobs[7]
    load_state_dict(store, 6)
    store.delete(LAYOUT.weights_dir(4), recursive=True)
    store.delete(LAYOUT.weights_dir(5), recursive=True)
    with pytest.raises(WeightsError, match="cannot rebuild from delta base v5"):
        load_weights_bytes(store, 7)
    for v in (7, 9):
        sd = load_state_dict(store, v)
        expected = st_load(blobs[v])
        assert sd.keys() == expected.keys()
        assert all(torch.equal(sd[k], expected[k]) for k in sd)


def test_publisher_publishes_full_after_a_gap_a_restart_and_for_non_safetensors(tmp_path, blobs):
    store = Store(str(tmp_path / "run"))
    pub = WeightPublisher(store, SIDE, delta=True, full_every=100)
    pub.publish(1, blobs[1])
    pub.publish(2, blobs[2])
    pub.publish(4, blobs[4])  # numbering gap: full
    assert DELTA_FILE in store.read_json(LAYOUT.manifest(2))["files"]
    assert WEIGHTS_FILE in store.read_json(LAYOUT.manifest(4))["files"]
    WeightPublisher(store, SIDE, delta=True).publish(5, blobs[5])  # a restarted trainer holds no base
    assert WEIGHTS_FILE in store.read_json(LAYOUT.manifest(5))["files"]
    pub = WeightPublisher(store, SIDE, delta=True, full_every=100)
    pub.publish(6, b"weights-6" * 50)
    pub.publish(7, b"weights-7" * 50)  # not safetensors: full
    assert load_weights_bytes(store, 7) == b"weights-7" * 50
    assert store.latest_version() == 7
    WeightPublisher(store, SIDE).publish(8, blobs[8])  # delta off: the plain layout, no "weights" entry
    assert "weights" not in store.read_json(LAYOUT.manifest(8))


@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_encode_decode_delta_codecs(blobs, codec):
    payload, info = encode_delta(blobs[3], blobs[4], codec=codec)
    assert decode_delta(blobs[3], payload, info) == blobs[4]
    assert info["width"] == 4 and len(payload) < len(blobs[4])
    assert encode_delta(blobs[3], blobs[3][:-4]) is None  # another layout


def test_corrupt_or_missing_delta_is_refused_naming_the_file(tmp_path, blobs):
    store = Store(str(tmp_path / "run"))
    publish_all(store, blobs[:4])
    good = store.read_bytes(LAYOUT.weights_file(2, DELTA_FILE))
    store.write_bytes(LAYOUT.weights_file(2, DELTA_FILE), good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(WeightsError, match=r"weights v2: model\.delta fails its sha256 check"):
        load_weights_bytes(store, 3)
    with pytest.raises(WeightsError, match=r"weights v2: model\.delta fails its sha256 check"):
        load_state_dict(store, 2)
    # a delta whose file checksum matches but that does not rebuild the recorded weights
    manifest = store.read_json(LAYOUT.manifest(2))
    other, _ = encode_delta(blobs[0], blobs[3])
    store.write_bytes(LAYOUT.weights_file(2, DELTA_FILE), other)
    manifest["files"][DELTA_FILE] = sha256(other)
    store.write_json(LAYOUT.manifest(2), manifest)
    with pytest.raises(WeightsError, match=r"weights v2: model\.safetensors rebuilt from model\.delta fails"):
        load_weights_bytes(store, 2)
    store.delete(LAYOUT.weights_dir(1), recursive=True)
    with pytest.raises(WeightsError, match=r"weights v3: cannot rebuild from delta base v1"):
        load_weights_bytes(store, 3)


def test_prune_keeps_the_chain_the_oldest_kept_version_needs(tmp_path, blobs):
    store = Store(str(tmp_path / "run"))
    publish_all(store, blobs, full_every=4)  # full: v0, v4, v8
    prune(store, 7)  # v7 = v4 + deltas 5, 6, 7
    assert store.listdir("weights") == ["LATEST", *(f"v{v:06d}" for v in range(4, 10))]
    assert load_weights_bytes(store, 7) == blobs[7] and load_weights_bytes(store, 9) == blobs[9]
    prune(store, 8)
    assert store.listdir("weights") == ["LATEST", "v000008", "v000009"]
    assert load_weights_bytes(store, 9) == blobs[9]


def test_stage_verified_rebuilds_a_delta_version_for_remote_engines(tmp_path, blobs):
    store = Store(str(tmp_path / "run"))
    publish_all(store, blobs[:4])
    path = stage_verified(store, 2, tmp_path / "stage")  # v0 full + deltas v1, v2 from the store
    assert (path / WEIGHTS_FILE).read_bytes() == blobs[2]
    assert (path / "config.json").read_bytes() == SIDE["config.json"]
    assert not (path / DELTA_FILE).exists()
    for v in (0, 1, 2):  # v3 is rebuilt from the staged v2 and its own delta
        store.delete(LAYOUT.weights_dir(v), recursive=True)
    assert (stage_verified(store, 3, tmp_path / "stage") / WEIGHTS_FILE).read_bytes() == blobs[3]
    with pytest.raises(WeightsError, match="cannot rebuild from delta base v2"):
        stage_verified(store, 3, tmp_path / "other")


def test_weight_delta_config_keys():
    cfg = load_config(None, ["train.weight_delta=true", "train.weight_full_every=4"])
    assert cfg.train.weight_delta and cfg.train.weight_full_every == 4
    assert load_config(None, []).train.weight_delta is False
    with pytest.raises(ConfigError, match="train.weight_full_every"):
        load_config(None, ["train.weight_full_every=0"])


@pytest.mark.slow
def test_a_run_with_delta_publication_trains_and_its_rollout_workers_follow(tiny_overrides):
    from areal_core.protocol import decode_shard
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch

    run_uri, _ = pipeline.prepare("", [*tiny_overrides, "train.weight_delta=true", "train.weight_full_every=4"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    launch(store.uri, 1, 1, timeout_s=300, progress=False)
    assert store.done() and store.latest_version() == 4
    kinds = {v: set(store.read_json(LAYOUT.manifest(v))["files"]) for v in range(5)}
    assert [WEIGHTS_FILE in kinds[v] for v in range(5)] == [True, False, False, False, True]
    final = st_load(store.read_bytes("final_model/model.safetensors"))
    rebuilt = st_load(load_weights_bytes(store, 4))
    assert all(torch.equal(rebuilt[k], final[k]) for k in rebuilt)
    produced = {
        v
        for p in store.find("trajectories/ungraded", ".arrow")
        for s in decode_shard(store.read_bytes(p))
        for v, m in zip(s.versions, s.loss_mask)
        if m
    }
    assert produced & {1, 2, 3}, produced  # step 3 trains tokens of v1..v3: all delta-published


# --- the codec itself (issue 57: format 3, the changed words and lanes only) ---------------------

SPECIAL_BF16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x7F7F]  # ±0, ±inf, NaNs, tiny, max


def bf16_file(bits: np.ndarray) -> bytes:
    """safetensors bytes of one bf16 tensor holding exactly these 16-bit patterns."""
    return st_save({"w": torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)})


def changed_bits(n: int, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 bit patterns (the special ones among them) and a copy with `frac` of them changed
    (±1 ulp, or to and from the special patterns)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    old[: min(n, len(SPECIAL_BF16))] = SPECIAL_BF16[:n]
    new = old.copy()
    moved = rng.choice(n, round(frac * n), replace=False)
    new[moved] += rng.choice(np.array([1, 65535], np.uint16), moved.size)  # ±1 mod 2**16
    special = moved[: moved.size // 4]
    new[special] = rng.choice(np.array(SPECIAL_BF16, np.uint16), special.size)
    return old, new


@pytest.mark.parametrize("n", [1, 3, 37, 4099, 70_001])
@pytest.mark.parametrize("frac", [0.0, 0.04, 1.0])
def test_bf16_round_trip_is_bit_exact(n, frac, monkeypatch):
    monkeypatch.setattr(delta_words, "CHUNK_WORDS", 64)  # many passes and both threads at these sizes
    monkeypatch.setattr(delta_words, "MIN_WORDS_PER_THREAD", 256)
    monkeypatch.setattr(delta_words.os, "sched_getaffinity", lambda pid: set(range(3)))
    old_bits, new_bits = changed_bits(n, frac, seed=n)
    old, new = bf16_file(old_bits), bf16_file(new_bits)
    for codec in ("zstd", "zlib"):
        payload, info = encode_delta(old, new, codec=codec)
        assert decode_delta(old, payload, info) == new
        # all changed: denser than the data, format 1 (below one word there is only the tail: format 3)
        assert info["format"] == (1 if frac == 1.0 and n >= 4 else 3)
        if info["format"] == 3:  # counted in the whole words; the tail (n % 4 elements) goes whole
            a, b = old_bits[: n // 4 * 4], new_bits[: n // 4 * 4]
            assert info["changed"] == int((a != b).sum())
            assert info["words"] == int((a != b).reshape(-1, 4).any(1).sum())


def test_special_bit_patterns_and_minus_zero_round_trip():
    old_bits = np.array(SPECIAL_BF16 * 5, np.uint16)
    new_bits = old_bits.copy()
    new_bits[::3] = np.roll(old_bits, 1)[::3]  # +0 -> -0, inf -> NaN, ...: equal as floats, not as bits
    old, new = bf16_file(old_bits), bf16_file(new_bits)
    payload, info = encode_delta(old, new)
    assert decode_delta(old, payload, info) == new
    assert info["format"] == 3 and info["changed"] == int((old_bits != new_bits).sum()) == 14


def test_a_4_percent_bf16_delta_is_stored_smaller_than_format_1():
    old_bits, new_bits = changed_bits(200_000, 0.04, seed=1)
    old, new = bf16_file(old_bits), bf16_file(new_bits)
    payload, info = encode_delta(old, new, codec="zstd")
    start, width = info["start"], info["width"]
    a, b = (np.frombuffer(x, f"<u{width}", offset=start) for x in (old, new))
    format_1 = delta_module._compress(delta_module._planes_of_differences(a, b), "zstd")
    assert info["format"] == 3 and info["changed"] == 8000
    assert len(payload) < 0.75 * len(format_1)
    assert len(payload) < 1.25 * 15838  # format 2 (git 041935a) stored these versions in 15,838 bytes


def test_other_widths_round_trip():
    gen = torch.Generator().manual_seed(0)
    old_sd = {"f": torch.randn(1001, generator=gen), "h": torch.randn(7, generator=gen).half()}  # mixed: width 1
    for old_t in (old_sd, {"f": old_sd["f"]}, {"d": old_sd["f"].double()}):
        new_t = {k: v.clone() for k, v in old_t.items()}
        for v in new_t.values():
            v[::50] += 1
        old, new = st_save(old_t), st_save(new_t)
        payload, info = encode_delta(old, new)
        assert decode_delta(old, payload, info) == new and info["format"] == 3


# Made by the codec before issue 57 (format 1, no "format" key) from bf16_file(OLD_FORMAT_BITS) to
# bf16_file(OLD_FORMAT_NEW_BITS): such deltas in a store keep decoding.
OLD_FORMAT_BITS = np.array([(i * 7919 + 32768) % 65536 for i in range(37)], np.uint16)
OLD_FORMAT_NEW_BITS = OLD_FORMAT_BITS.copy()
OLD_FORMAT_NEW_BITS[[0, 5, 17, 36]] = [OLD_FORMAT_BITS[0] + 1, 0x7FC0, 0x8000, 0x7F80]
OLD_FORMAT = {
    "zstd": "28b52ffd204add00008002000000002a00bd003700ca001b00b4051000130366f1c4b011",
    "zlib": "7801636200022d1001057b610c046d0e669e4208304823b1a1cc2d005a7f02ba",
}


@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_an_old_format_delta_still_decodes(codec):
    old, new = bf16_file(OLD_FORMAT_BITS), bf16_file(OLD_FORMAT_NEW_BITS)
    info = {"codec": codec, "start": 72, "width": 2, "size": 146}  # the manifest entry of then
    assert decode_delta(old, bytes.fromhex(OLD_FORMAT[codec]), info) == new


def test_a_format_2_bomb_or_bad_positions_are_refused():
    old = bf16_file(np.zeros(1000, np.uint16))
    info = {"format": 2, "codec": "zstd", "start": 72, "width": 2, "size": len(old), "changed": 10, "gap_width": 2}
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(32 << 20))  # declares 32 MiB
    assert len(bomb) < 4096
    with pytest.raises(ValueError, match="holds 41 bytes, expected 40"):  # stopped at the expected size + 1
        decode_delta(old, bomb, info)
    with pytest.raises(ValueError, match="does not fit 1000 elements"):  # more than the data: never inflated
        decode_delta(old, bomb, {**info, "changed": 501})
    past_the_end = np.zeros(40, np.uint8)
    past_the_end[9] = 250  # the 10th gap's low byte: its position lands at 9 + 250 * 4 > 999
    past_the_end[19] = 250
    with pytest.raises(ValueError, match="not ascending within 1000 elements"):
        decode_delta(old, zstandard.ZstdCompressor().compress(past_the_end.tobytes()), info)
    with pytest.raises(ValueError, match="unknown delta format 4"):
        decode_delta(old, bomb, {**info, "format": 4})


# Made by format 2's encoder (git 041935a) from bf16_file(OLD_FORMAT_BITS) to bf16_file(OLD_FORMAT_NEW_BITS):
# stored runs of format 2 keep decoding.
FORMAT_2 = {
    "zstd": "28b52ffd200c61000000040b12016bdf1c00650da6",
    "zlib": "78016360e11662ccbe2fc390cabb0c000bf202a1",
}


@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_a_format_2_delta_still_decodes(codec):
    old, new = bf16_file(OLD_FORMAT_BITS), bf16_file(OLD_FORMAT_NEW_BITS)
    info = {"format": 2, "codec": codec, "start": 72, "width": 2, "size": 146, "changed": 4, "gap_width": 1}
    assert decode_delta(old, bytes.fromhex(FORMAT_2[codec]), info) == new


def format_3_pair() -> tuple[bytes, bytes, bytes, dict]:
    """1000 bf16 elements (250 words), 40 of them changed: old, new, the zstd payload, its manifest entry."""
    old_bits, new_bits = changed_bits(1000, 0.04, seed=3)
    old, new = bf16_file(old_bits), bf16_file(new_bits)
    payload, info = encode_delta(old, new, codec="zstd")
    assert info["format"] == 3 and info["changed"] == 40 and decode_delta(old, payload, info) == new
    return old, new, payload, info


def test_a_format_3_bomb_or_counts_beyond_the_data_are_refused_before_inflating():
    old, _, _, info = format_3_pair()
    expected = 32 + (info["words"] * 4 + 7) // 8 + 2 * 40  # word bits, lane bits, values (no tail)
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(32 << 20))  # declares 32 MiB
    with pytest.raises(ValueError, match=f"holds {expected + 1} bytes, expected {expected}"):
        decode_delta(old, bomb, info)  # stopped at the expected size + 1
    for words, changed in ((251, 251), (10, 41), (40, 30), (-1, 40)):  # more words than the data, ...
        with pytest.raises(ValueError, match="does not fit 250 words"):
            decode_delta(old, bomb, {**info, "words": words, "changed": changed})
    with pytest.raises(ValueError, match="does not fit 2000 bytes of data"):  # every lane of every word: 2157 bytes
        decode_delta(old, bomb, {**info, "words": 250, "changed": 1000})


def test_a_truncated_or_corrupt_format_3_frame_is_refused():
    old, _, payload, info = format_3_pair()
    with pytest.raises(ValueError, match="holds 0 bytes, expected"):  # a frame cut short
        decode_delta(old, payload[:-5], info)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(payload))
    with pytest.raises(ValueError, match="holds"):  # a frame one byte short of what the counts give
        decode_delta(old, zstandard.ZstdCompressor().compress(bytes(raw[:-1])), info)
    raw[0] ^= 0xFF  # eight words flipped in the word bitmap
    with pytest.raises(ValueError, match="word bitmap does not name"):
        decode_delta(old, zstandard.ZstdCompressor().compress(bytes(raw)), info)
    raw[0] ^= 0xFF
    raw[32] ^= 0x01  # one lane flipped in the lane bitmap
    with pytest.raises(ValueError, match="lane bitmap does not name 40"):
        decode_delta(old, zstandard.ZstdCompressor().compress(bytes(raw)), info)


@pytest.mark.parametrize("nbytes", [0, 7, 8, 9, 1023])
def test_width_1_data_of_any_length_round_trips_with_its_tail(nbytes):
    rng = np.random.default_rng(nbytes)
    old_t = {
        "f": torch.from_numpy(rng.standard_normal(3).astype(np.float32)),
        "b": torch.zeros(nbytes, dtype=torch.uint8),
    }
    new_t = {"f": old_t["f"].clone(), "b": torch.from_numpy(rng.integers(0, 2, nbytes, dtype=np.uint8))}
    new_t["f"][1] = -0.0
    old, new = st_save(old_t), st_save(new_t)
    payload, info = encode_delta(old, new)
    assert info["width"] == 1 and decode_delta(old, payload, info) == new
