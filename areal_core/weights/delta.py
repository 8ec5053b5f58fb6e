"""The delta codec of delta weight publication: consecutive safetensors files, bit-exact.

Format 3 (written now, issue 57; delta_words.py): the data read as 64-bit words, XORed in chunks
that stay in cache, over every core: a bitmap of the words that changed, a bitmap of the lanes
(elements) that changed in those words, and the nonzero lanes' XOR as byte planes (the high bytes
are mostly zero), compressed as one frame with multi-threaded zstd (zlib where zstandard is
missing). A delta whose payload would exceed the data itself (a float32 step changes ~99% of the
elements) is written in format 1.

Format 2 (issue 57's first codec; still decoded): the changed elements' gaps between positions (in
1, 2, 4 or 8 bytes) and their XOR, each as byte planes, compressed as above.

Format 1 (manifests without "format"; still decoded, and written for dense deltas): the
element-wise integer difference of the raw bits (mod 2**bits), zigzag coded so small ± changes
become small numbers, as byte planes of every element, compressed as above.

Whatever a payload's frame declares, decoding inflates at most the size the manifest's counts give
(never more than the base's data size) + 1 bytes.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from areal_core.weights.delta_words import apply_words, encode_words, sizes, unplanes

_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
FORMAT = 3  # what encode_delta writes for a sparse delta; decode_delta reads 1, 2 and 3


def _layout(blob: bytes) -> tuple[int, int] | None:
    """(data start, element width) of a safetensors blob; None if it is not one."""
    if len(blob) < 8:
        return None
    start = 8 + int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8:start])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict) or start > len(blob):
        return None
    sizes = {_ITEMSIZE.get(v.get("dtype"), 1) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    width = sizes.pop() if len(sizes) == 1 else 1
    return start, width if (len(blob) - start) % width == 0 else 1


def _codec() -> str:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return "zlib"
    return "zstd"


def _compress(data: bytes, codec: str) -> bytes:
    """zstd level 1 on every core (zstandard's threads=-1), or zlib level 1."""
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=1, threads=-1).compress(data)
    return zlib.compress(data, 1)


def _decompress(data: bytes, codec: str, size: int) -> np.ndarray:
    """At most `size + 1` bytes of `data` inflated (uint8), whatever its frame declares: a bomb stops
    there (zstandard's `max_output_size` is ignored when the frame header states a content size, so
    the frame is read as a stream, into a buffer of size + 1 bytes; zlib's `max_length` bounds a
    decompressobj the same way)."""
    if codec == "zstd":
        import zstandard

        out, got = np.empty(size + 1, np.uint8), 0
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while got <= size and (n := reader.readinto(out[got:])):
                got += n
        return out[:got]
    if codec == "zlib":
        return np.frombuffer(zlib.decompressobj().decompress(data, size + 1), np.uint8)
    raise ValueError(f"unknown codec {codec!r}")


def encode_delta(old: bytes, new: bytes, codec: str | None = None) -> tuple[bytes, dict[str, Any]] | None:
    """The compressed delta turning `old` into `new`, and its manifest entry (without base and
    sha256); None when the two are not safetensors files of the same layout (full publish then)."""
    layout = _layout(new)
    if layout is None or len(old) != len(new) or old[: layout[0]] != new[: layout[0]]:
        return None
    start, width = layout
    codec = codec or _codec()
    info = {"format": FORMAT, "codec": codec, "start": start, "width": width, "size": len(new)}
    a, b = np.frombuffer(old, np.uint8, offset=start), np.frombuffer(new, np.uint8, offset=start)
    found = encode_words(a, b, width)
    if found is not None:
        payload, words, lanes = found
        return _compress(payload, codec), {**info, "words": words, "changed": lanes}
    # denser: every element's difference (format 1)
    dtype = np.dtype(f"<u{width}")
    return _compress(_planes_of_differences(a.view(dtype), b.view(dtype)), codec), {**info, "format": 1}


def apply_delta(data: np.ndarray, payload: bytes, info: dict[str, Any]) -> None:
    """Apply a delta from `encode_delta` (format 1, 2 or 3) in place to `data`, the base file's bytes
    (a writable uint8 array); ValueError (or the codec's error) if it does not fit."""
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.writeable or not data.flags.c_contiguous:
        raise ValueError("apply_delta needs the base as a writable, contiguous 1-D uint8 array")
    start, width, size = int(info["start"]), int(info["width"]), int(info["size"])
    if data.size != size or width not in (1, 2, 4, 8) or not 0 <= start <= size or (size - start) % width:
        raise ValueError(f"the delta (width {width}, {size} bytes) does not fit a base of {data.size} bytes")
    version = info.get("format", 1)
    if version not in (1, 2, 3):
        raise ValueError(f"unknown delta format {version!r}")
    if version == 3:
        return _apply_words(data[start:], width, payload, info)
    elements = data[start:].view(f"<u{width}")
    (_apply_changes if version == 2 else _apply_differences)(elements, payload, info)


def _apply_words(data: np.ndarray, width: int, payload: bytes, info: dict[str, Any]) -> None:
    """Format 3: check the counts against the data, inflate at most the size they give, apply."""
    words, lanes, nw = int(info["words"]), int(info["changed"]), data.size // 8
    if not (0 <= words <= nw and words <= lanes <= words * (8 // width)):
        raise ValueError(f"a delta of {words} words and {lanes} elements changed does not fit {nw} words")
    expected = sum(sizes(data.size, width, words, lanes))
    if expected > data.size:
        raise ValueError(f"a delta of {expected} bytes does not fit {data.size} bytes of data")
    raw = _decompress(payload, str(info["codec"]), expected)
    if len(raw) != expected:
        raise ValueError(f"delta holds {len(raw)} bytes, expected {expected}")
    apply_words(data, raw, width, words, lanes)


def decode_delta(old: bytes, payload: bytes, info: dict[str, Any]) -> bytes:
    """`old` with a delta from `encode_delta` applied (apply_delta on a copy)."""
    out = np.frombuffer(old, np.uint8).copy()  # numpy asks for huge pages: a fast copy
    apply_delta(out, payload, info)
    return out.tobytes()


def _apply_changes(elements: np.ndarray, payload: bytes, info: dict[str, Any]) -> None:
    """Format 2: XOR the changed elements at the positions the gaps give."""
    n, width, changed, gap_width = elements.size, elements.itemsize, int(info["changed"]), int(info["gap_width"])
    expected = changed * (gap_width + width)
    if gap_width not in (1, 2, 4, 8) or not 0 <= changed <= n or expected > elements.nbytes:
        raise ValueError(f"a delta of {changed} changed elements does not fit {n} elements")
    raw = _decompress(payload, str(info["codec"]), expected)
    if len(raw) != expected:
        raise ValueError(f"delta holds {len(raw)} bytes, expected {expected}")
    positions = unplanes(raw, np.dtype(f"<u{gap_width}"), changed).astype(np.int64)  # the gaps
    positions += 1
    np.cumsum(positions, out=positions)  # a gap of 2**63 or more turns negative: refused below
    positions -= 1
    if changed and (positions[0] < 0 or positions[-1] >= n or np.any(positions[1:] <= positions[:-1])):
        raise ValueError(f"the delta's positions are not ascending within {n} elements")
    elements[positions] ^= unplanes(raw[changed * gap_width :], elements.dtype, changed)


_CHUNK = 1 << 18  # elements per numpy pass of format 1: the temporaries stay in cache


def _planes_of_differences(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Format 1's payload: zigzag(b - a mod 2**bits) of every element, as byte planes."""
    width, dtype = a.itemsize, a.dtype
    planes = np.empty((width, a.size), np.uint8)  # byte k of every element together: high bytes ~ 0
    d, sign = np.empty(_CHUNK, dtype), np.empty(_CHUNK, dtype)
    for i in range(0, a.size, _CHUNK):
        j = min(i + _CHUNK, a.size)
        dd, ss = d[: j - i], sign[: j - i]
        np.subtract(b[i:j], a[i:j], out=dd)  # mod 2**bits
        np.right_shift(dd, 8 * width - 1, out=ss)
        np.negative(ss, out=ss)
        np.left_shift(dd, 1, out=dd)
        np.bitwise_xor(dd, ss, out=dd)  # zigzag: small ± changes -> small numbers
        view = dd.view(np.uint8).reshape(-1, width)
        for k in range(width):
            planes[k, i:j] = view[:, k]
    return planes


def _apply_differences(elements: np.ndarray, payload: bytes, info: dict[str, Any]) -> None:
    """Format 1: add every element's zigzag-decoded difference (mod 2**bits)."""
    width, dtype = elements.itemsize, elements.dtype
    raw = _decompress(payload, str(info["codec"]), elements.nbytes)
    if len(raw) != elements.nbytes:
        raise ValueError(f"delta holds {len(raw)} bytes, expected {elements.nbytes}")
    planes = raw.reshape(width, -1)
    z, sign = np.empty(_CHUNK, dtype), np.empty(_CHUNK, dtype)
    for i in range(0, elements.size, _CHUNK):
        j = min(i + _CHUNK, elements.size)
        zz, ss = z[: j - i], sign[: j - i]
        view = zz.view(np.uint8).reshape(-1, width)
        for k in range(width):
            view[:, k] = planes[k, i:j]
        np.bitwise_and(zz, 1, out=ss)
        np.negative(ss, out=ss)
        np.right_shift(zz, 1, out=zz)
        np.bitwise_xor(zz, ss, out=zz)
        np.add(elements[i:j], zz, out=elements[i:j])
