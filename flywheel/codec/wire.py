"""Serialized `WeightChunk`s without the message-object copies.

A `WeightChunk` message object costs two extra copies of its payload per side
with protobuf's upb runtime: building one copies the bytes into the message
(after a first copy out of the tensor into a `bytes`), serializing copies
them again, and on the receiver parsing copies them into the message and
reading `.data` copies them out once more. A transport that carries the
serialized form as-is (gRPC method handlers with no (de)serializer) can use
these two functions instead:

* `serialize_chunk` writes a chunk's wire bytes with ONE copy of the payload,
  straight from the tensor's memory: the small header fields are serialized
  by protobuf, then the payload is appended as field 7. Field order is free
  in the protobuf wire format, so any protobuf parser reads the result as the
  same `WeightChunk`.
* `parse_chunk` splits wire bytes into the header fields (parsed by protobuf
  from the few header bytes) and a zero-copy memoryview of the payload.

The bytes are exactly a `WeightChunk`: the two forms mix freely on one stream.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from flywheel.codec.errors import ChunkCorrupted
from flywheel.common.v1 import common_pb2
from flywheel.varint import LEN, WireError, encode_varint, field_key, iter_fields

_DATA_FIELD = 7  # WeightChunk.data
#: The key of a serialized WeightChunk's data field.
DATA_TAG = field_key(_DATA_FIELD, LEN)


def serialize_chunk(header: common_pb2.WeightChunk, payload: memoryview | bytes) -> bytes:
    """Wire bytes of `header` (whose data must be empty) with `payload` as its data."""
    if header.data:
        raise ValueError("serialize_chunk: the header's data field must be empty")
    if not len(payload):
        return header.SerializeToString()
    return b"".join((header.SerializeToString(), DATA_TAG, encode_varint(len(payload)), payload))


def parse_chunk(buf: bytes | bytearray | memoryview) -> tuple[common_pb2.WeightChunk, memoryview]:
    """(header fields, payload view) of a serialized WeightChunk.

    The header message has an empty `data`; the payload is a zero-copy view
    of `buf`. Malformed bytes raise ChunkCorrupted.
    """
    view = memoryview(buf).cast("B")
    header_parts: list[memoryview] = []
    payload = view[:0]
    start = 0
    try:
        for field, wire_type, field_start, value_start, end in iter_fields(view):
            if field == _DATA_FIELD and wire_type == LEN:
                # Protobuf semantics: the last occurrence of a bytes field wins.
                header_parts.append(view[start:field_start])
                payload, start = view[value_start:end], end
    except WireError as exc:
        raise ChunkCorrupted(f"chunk is not a valid serialized WeightChunk: {exc}") from None
    header_parts.append(view[start:])
    try:
        header = common_pb2.WeightChunk.FromString(b"".join(header_parts))
    except DecodeError as exc:
        raise ChunkCorrupted(f"chunk is not a valid serialized WeightChunk: {exc}") from None
    return header, payload
