"""The Confluent wire format: how a registry-aware Kafka value is laid out.

``[0x00][schema id: 4 bytes, big-endian][payload]``. Protobuf payloads are preceded by the
index path of the message type inside its ``.proto`` file (an array of zig-zag varints: its
length, then the indexes; the common ``[0]``, the file's first message, is the single byte
``0x00``). Avro payloads are Avro's binary encoding, with no header of their own.

This module owns the format: framing, unframing and the index path, written and parsed here
only. Every malformed input raises :class:`~onceflow.kernel.errors.CodecError` with what was
found, which the Kafka source turns into a dead letter.
"""

from __future__ import annotations

import struct

from onceflow.kernel.errors import CodecError

MAGIC = 0
HEADER = struct.Struct(">bI")  # magic byte, schema id
HEADER_SIZE = HEADER.size  # 5
MAX_VARINT_BYTES = 10
MAX_INDEXES = 1000  # a deeper nesting than any .proto has: the bytes are not an index path


def frame(schema_id: int, payload: bytes) -> bytes:
    """``payload`` with the magic byte and ``schema_id`` in front."""
    return HEADER.pack(MAGIC, schema_id) + payload


def unframe(data: bytes) -> tuple[int, memoryview]:
    """``(schema id, payload)`` of a wire-format value; CodecError if it is not one."""
    if len(data) < HEADER_SIZE:
        msg = (
            f"not in the schema registry wire format: {len(data)} bytes, fewer than the "
            f"{HEADER_SIZE}-byte header (magic byte 0, 4-byte schema id)"
        )
        raise CodecError(msg)
    magic, schema_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        msg = (
            f"not in the schema registry wire format: the first byte is {data[0]:#04x}, not the "
            "magic byte 0x00 (was this value written by a registry-aware producer?)"
        )
        raise CodecError(msg)
    return schema_id, memoryview(data)[HEADER_SIZE:]


def _zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63)


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while value > 0x7F:  # noqa: PLR2004 - seven bits per byte
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """``(value, next position)`` of the varint at ``pos``."""
    result = shift = 0
    for i in range(MAX_VARINT_BYTES):
        if pos + i >= len(data):
            msg = "the Protobuf message index path is cut short (a varint runs past the value)"
            raise CodecError(msg)
        byte = data[pos + i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos + i + 1
        shift += 7
    msg = "the Protobuf message index path holds a varint longer than 10 bytes"
    raise CodecError(msg)


def encode_indexes(indexes: tuple[int, ...]) -> bytes:
    """The message index path: ``[0]`` as one zero byte, else length and indexes, zig-zag."""
    if indexes == (0,):
        return b"\x00"
    return b"".join(_varint(_zigzag(v)) for v in (len(indexes), *indexes))


def decode_indexes(payload: memoryview) -> tuple[tuple[int, ...], memoryview]:
    """``(index path, message bytes)`` of a Protobuf payload (after the 5-byte header)."""
    raw, pos = _read_varint(payload, 0)
    count = _unzigzag(raw)
    if count == 0:
        return (0,), payload[pos:]
    if count < 0 or count > MAX_INDEXES:
        msg = f"the Protobuf message index path says it holds {count} indexes: not an index path"
        raise CodecError(msg)
    indexes = []
    for _ in range(count):
        raw, pos = _read_varint(payload, pos)
        indexes.append(_unzigzag(raw))
    return tuple(indexes), payload[pos:]
