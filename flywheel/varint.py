"""The protobuf wire format by hand: base-128 varints and the walk over a message's fields.

The hand-rolled wire code (`flywheel.codec.wire`'s zero-copy chunks,
`flywheel.transfer.frames`, `flywheel.runtime.proto_utf8`) encodes and
decodes varints and walks fields here; each caller turns `WireError` into its
own domain error. Plain Python, no imports: anything may use it.
"""

from __future__ import annotations

from collections.abc import Iterator

LEN = 2  # wire type of length-delimited fields (bytes, strings, messages)


class WireError(ValueError):
    """Bytes that are not a protobuf message's wire format."""


class VarintError(WireError):
    """The bytes end inside a varint, or it runs past 10 bytes (64 bits)."""


def encode_varint(n: int) -> bytes:
    """The varint bytes of a non-negative `n`."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_key(number: int, wire_type: int) -> bytes:
    """The key bytes that start field `number` of wire type `wire_type`."""
    return encode_varint((number << 3) | wire_type)


def read_varint(buf: bytes | bytearray | memoryview, i: int) -> tuple[int, int]:
    """(value, index after it) of the varint that starts at `buf[i]`; `buf` indexes to ints."""
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise VarintError("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def iter_fields(buf: bytes | bytearray | memoryview) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field of a serialized message, in wire order, as
    (field number, wire type, start of its key, start of its value, end).

    A length-delimited field's value starts after its length prefix, so
    `buf[value_start:end]` is its payload. Raises `WireError` on a wire type
    other than varint, 64-bit, length-delimited or 32-bit (groups included),
    on a truncated varint, and on a field that runs past the end of `buf`.
    """
    i, size = 0, len(buf)
    while i < size:
        field_start = i
        key, i = read_varint(buf, i)
        number, wire_type = key >> 3, key & 7
        value_start = i
        if wire_type == 0:
            _, end = read_varint(buf, i)
        elif wire_type == 1:
            end = i + 8
        elif wire_type == 5:
            end = i + 4
        elif wire_type == LEN:
            length, value_start = read_varint(buf, i)
            end = value_start + length
        else:
            raise WireError(f"wire type {wire_type}")
        if end > size:
            raise WireError("a field runs past the end")
        yield number, wire_type, field_start, value_start, end
        i = end
