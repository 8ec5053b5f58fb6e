"""Read an Arrow IPC file from an untrusted store without trusting it.

pyarrow's file reader follows the footer's offsets and does not fully validate the buffers it
maps (offsets that are not monotonic make a later `to_pylist` read out of bounds), and it
decompresses LZ4/ZSTD bodies before anything can check their size (a 21 KB file inflates to
1.65 GB). Here the file is read as the stream it contains: every message is bounded by the
bytes present; a compressed body is refused before it is inflated (the project's writer never
compresses) or, for a user's table (`max_inflated`), admitted only while the sizes its buffers
declare stay within a budget (Arrow inflates each buffer into exactly its declared size); each
record batch is validated in full (`RecordBatch.validate(full=True)`) before any value is read;
the row count is capped.
"""

from __future__ import annotations

import pyarrow as pa

MAGIC = b"ARROW1"


class IpcError(ValueError):
    """The bytes are not an Arrow IPC file this reader accepts; the message says why."""


def _u32(buf: bytes, at: int) -> int:
    if at < 0 or at + 4 > len(buf):
        raise IpcError("message metadata is truncated")
    return int.from_bytes(buf[at : at + 4], "little")


def _field(buf: bytes, table: int, index: int) -> int | None:
    """The absolute position of field `index` of the flatbuffer table at `table`; None when absent."""
    vtable = table - int.from_bytes(buf[table : table + 4], "little", signed=True)
    if vtable < 0 or vtable + 4 > len(buf):
        raise IpcError("message metadata has a bad vtable")
    vt_len = int.from_bytes(buf[vtable : vtable + 2], "little")
    slot = 4 + 2 * index
    if slot + 2 > vt_len:
        return None
    off = int.from_bytes(buf[vtable + slot : vtable + slot + 2], "little")
    return table + off if off else None


def is_compressed(metadata: bytes) -> bool:
    """Whether a record-batch message's metadata (the flatbuffer `Message`) declares a body
    compression: Message.header (field 2) → RecordBatch.compression (field 3)."""
    root = _u32(metadata, 0)
    header = _field(metadata, root, 2)
    if header is None:
        raise IpcError("record batch message without a header")
    batch = header + _u32(metadata, header)
    return _field(metadata, batch, 3) is not None


def declared_inflated_bytes(metadata: bytes, body: bytes) -> int:
    """What a compressed record batch's buffers inflate to, as each declares: Arrow's body
    compression prefixes every buffer with its uncompressed length (int64, -1: stored as is).
    RecordBatch.buffers (field 2) is a vector of 16-byte structs (offset, length) into `body`."""
    root = _u32(metadata, 0)
    header = _field(metadata, root, 2)
    if header is None:
        raise IpcError("record batch message without a header")
    batch = header + _u32(metadata, header)
    at = _field(metadata, batch, 2)
    if at is None:
        return 0
    vector = at + _u32(metadata, at)
    count = _u32(metadata, vector)
    if vector + 4 + 16 * count > len(metadata):
        raise IpcError("message metadata is truncated")
    total = 0
    for i in range(count):
        entry = vector + 4 + 16 * i
        offset, length = (int.from_bytes(metadata[k : k + 8], "little", signed=True) for k in (entry, entry + 8))
        if length == 0:
            continue
        if offset < 0 or length < 8 or offset + length > len(body):
            raise IpcError("a compressed buffer outside the message body")
        declared = int.from_bytes(body[offset : offset + 8], "little", signed=True)
        total += length - 8 if declared == -1 else declared
    return total


def read_ipc_file(data: bytes, max_rows: int, max_inflated: int | None = None) -> pa.Table:
    """The table in the IPC file `data`, every batch validated in full; IpcError otherwise.
    `max_inflated`: compressed batches are admitted up to that many declared bytes in all (None:
    refused)."""
    if len(data) < 12 or data[:6] != MAGIC or data[-6:] != MAGIC:
        raise IpcError(f"not a readable Arrow IPC file ({len(data)} bytes: no ARROW1 magic at both ends)")
    return _read_messages(data, 8, max_rows, max_inflated)


def read_ipc_stream(data: bytes, max_rows: int, max_inflated: int | None = None) -> pa.Table:
    """The table in the IPC stream `data` (what `datasets.save_to_disk` writes), as `read_ipc_file`."""
    return _read_messages(data, 0, max_rows, max_inflated)


def _read_messages(data: bytes, start: int, max_rows: int, max_inflated: int | None) -> pa.Table:
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(pa.py_buffer(data)[start:]))
        schema = pa.ipc.read_schema(reader.read_next_message())
        batches, rows, inflated = [], 0, 0
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type != "record batch":
                raise IpcError(f"unexpected {message.type} message (shards hold record batches only)")
            metadata = message.metadata.to_pybytes()
            if is_compressed(metadata):
                if max_inflated is None:
                    raise IpcError("a compressed record batch (shards are written uncompressed)")
                inflated += declared_inflated_bytes(metadata, message.body.to_pybytes())
                if inflated > max_inflated:
                    raise IpcError(f"compressed record batches that inflate past {max_inflated} bytes")
            batch = pa.ipc.read_record_batch(message, schema)
            rows += batch.num_rows
            if rows > max_rows:
                raise IpcError(f"more than {max_rows} rows")
            batch.validate(full=True)
            batches.append(batch)
    except IpcError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
        raise IpcError(f"not a readable Arrow IPC file ({len(data)} bytes): {exc}") from None
    return pa.Table.from_batches(batches, schema)
