"""The delta codec of delta weight publication: consecutive safetensors files, bit-exact.

The delta is the element-wise integer difference of the raw bits of two safetensors files of
the same layout (mod 2**bits), zigzag coded so small ± changes become small numbers, split
into byte planes (byte k of every element together: the high bytes of a small optimizer
update are mostly zero) and compressed with zstd (zlib where zstandard is missing).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


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
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(data)
    return zlib.compress(data, 1)


def _decompress(data: bytes, codec: str, size: int) -> bytes:
    """At most `size + 1` bytes of `data` inflated, whatever its frame declares: a bomb stops there
    (zstandard's `max_output_size` is ignored when the frame header states a content size, so
    the frame is read as a stream; zlib's `max_length` bounds a decompressobj the same way)."""
    if codec == "zstd":
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            chunks, got = [], 0
            while got <= size and (chunk := reader.read(min(size + 1 - got, 1 << 24))):
                chunks.append(chunk)
                got += len(chunk)
        return b"".join(chunks)
    if codec == "zlib":
        return zlib.decompressobj().decompress(data, size + 1)
    raise ValueError(f"unknown codec {codec!r}")


_CHUNK = 1 << 18  # elements per numpy pass: the temporaries stay in cache


def encode_delta(old: bytes, new: bytes, codec: str | None = None) -> tuple[bytes, dict[str, Any]] | None:
    """The compressed delta turning `old` into `new`, and its manifest entry (without base and
    sha256); None when the two are not safetensors files of the same layout (full publish then)."""
    layout = _layout(new)
    if layout is None or len(old) != len(new) or old[: layout[0]] != new[: layout[0]]:
        return None
    start, width = layout
    dtype = np.dtype(f"<u{width}")
    a, b = np.frombuffer(old, dtype, offset=start), np.frombuffer(new, dtype, offset=start)
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
    codec = codec or _codec()
    return _compress(planes, codec), {"codec": codec, "start": start, "width": width, "size": len(new)}


def decode_delta(old: bytes, payload: bytes, info: dict[str, Any]) -> bytes:
    """Apply a delta from `encode_delta` to `old`; ValueError (or the codec's error) if it does not fit."""
    start, width, size = int(info["start"]), int(info["width"]), int(info["size"])
    if len(old) != size or width not in (1, 2, 4, 8) or (size - start) % width:
        raise ValueError(f"the delta (width {width}, {size} bytes) does not fit a base of {len(old)} bytes")
    raw = _decompress(payload, str(info["codec"]), size - start)
    if len(raw) != size - start:
        raise ValueError(f"delta holds {len(raw)} bytes, expected {size - start}")
    dtype = np.dtype(f"<u{width}")
    planes = np.frombuffer(raw, np.uint8).reshape(width, -1)
    a = np.frombuffer(old, dtype, offset=start)
    out = bytearray(size)
    out[:start] = old[:start]
    result = np.frombuffer(out, dtype, offset=start)
    z, sign = np.empty(_CHUNK, dtype), np.empty(_CHUNK, dtype)
    for i in range(0, a.size, _CHUNK):
        j = min(i + _CHUNK, a.size)
        zz, ss = z[: j - i], sign[: j - i]
        view = zz.view(np.uint8).reshape(-1, width)
        for k in range(width):
            view[:, k] = planes[k, i:j]
        np.bitwise_and(zz, 1, out=ss)
        np.negative(ss, out=ss)
        np.right_shift(zz, 1, out=zz)
        np.bitwise_xor(zz, ss, out=zz)
        np.add(a[i:j], zz, out=result[i:j])
    del result  # release the export before the copy
    return bytes(out)
