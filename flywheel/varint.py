"""The protobuf wire format's base-128 varint, written and read.

The hand-rolled wire code (`flywheel.codec.wire`'s zero-copy chunks,
`flywheel.transfer.frames`, `flywheel.runtime.proto_utf8`) encodes and
decodes varints here; each caller turns `VarintError` into its own domain
error. Plain Python, no imports: anything may use it.
"""

from __future__ import annotations


class VarintError(ValueError):
    """The bytes end inside a varint, or it runs past 10 bytes (64 bits)."""


def encode_varint(n: int) -> bytes:
    """The varint bytes of a non-negative `n`."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


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
