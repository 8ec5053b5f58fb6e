"""Read an Arrow IPC file from an untrusted store without trusting it.

pyarrow's file reader follows the footer's offsets and does not fully validate the buffers it
maps (offsets that are not monotonic make a later `to_pylist` read out of bounds), and it
decompresses LZ4/ZSTD bodies before anything can check their size (a 21 KB file inflates to
1.65 GB). Here the file is read as the stream it contains: every message is bounded by the
bytes present; a compressed body is refused before it is inflated (the project's writer never
compresses); each record batch is validated in full (`RecordBatch.validate(full=True)`) before
any value is read; the row count is capped.
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


def read_ipc_file(data: bytes, max_rows: int) -> pa.Table:
    """The table in the IPC file `data`, every batch validated in full; IpcError otherwise."""
    if len(data) < 12 or data[:6] != MAGIC or data[-6:] != MAGIC:
        raise IpcError(f"not a readable Arrow IPC file ({len(data)} bytes: no ARROW1 magic at both ends)")
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(pa.py_buffer(data)[8:]))
        schema = pa.ipc.read_schema(reader.read_next_message())
        batches, rows = [], 0
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type != "record batch":
                raise IpcError(f"unexpected {message.type} message (shards hold record batches only)")
            if is_compressed(message.metadata.to_pybytes()):
                raise IpcError("a compressed record batch (shards are written uncompressed)")
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
