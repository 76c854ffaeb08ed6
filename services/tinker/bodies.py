"""Request bodies of the Tinker API: bounded on both sides, and checked field by field.

A body is refused with 413 once it is larger than `max_body_bytes` as sent
(its Content-Length, or the bytes read so far: reading stops there), and a
zstd body (forward_backward's, `Content-Encoding: zstd`) once it would
decompress past the same bound: a frame that states its size is refused on
that statement before anything is decompressed or allocated (as
flywheel/transfer/compression.py does for weight chunks); one that does not is
decompressed a mebibyte at a time and refused when it passes the bound.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import zstandard

from flywheel.errors import InvalidArgument
from services.tinker import metrics

#: Decompressed a piece at a time: the most a frame without a stated size costs beyond the bound.
_PIECE = 1 << 20


class BodyTooLarge(Exception):
    """A body past the bound (HTTP 413)."""


def refuse_unknown(body: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(body) - allowed - {"type"})
    if unknown:
        raise InvalidArgument(f"{what}: {unknown[0]} is not served by this gateway")


def seq_number(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{what} must be an integer >= 0, got {value!r}")
    return value


async def read_bounded(stated_length: str | None, chunks: AsyncIterator[bytes], limit: int, what: str) -> bytes:
    """The body as sent, refused past `limit` bytes (on its Content-Length before reading any of it)."""
    if stated_length is not None and stated_length.isdigit() and int(stated_length) > limit:
        metrics.BODIES_REFUSED.labels("sent").inc()
        raise BodyTooLarge(f"{what}: the body is {int(stated_length)} bytes, more than max_body_bytes={limit}")
    pieces, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            metrics.BODIES_REFUSED.labels("sent").inc()
            raise BodyTooLarge(f"{what}: the body is more than max_body_bytes={limit} bytes")
        pieces.append(chunk)
    return b"".join(pieces)


def decompressed(body: bytes, limit: int, what: str) -> bytes:
    """A zstd body decompressed, refused past `limit` bytes (on its stated size before anything is allocated)."""
    try:
        stated = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise InvalidArgument(f"{what}: the body is not a zstd frame ({exc})") from None
    if stated > limit:  # -1: the frame does not say
        metrics.BODIES_REFUSED.labels("decompressed").inc()
        raise BodyTooLarge(f"{what}: the zstd frame states {stated} bytes, more than max_body_bytes={limit}")
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while piece := reader.read(min(_PIECE, limit + 1 - size)):
                size += len(piece)
                if size > limit:
                    metrics.BODIES_REFUSED.labels("decompressed").inc()
                    raise BodyTooLarge(f"{what}: the zstd body decompresses to more than max_body_bytes={limit}")
                out.append(piece)
    except zstandard.ZstdError as exc:
        raise InvalidArgument(f"{what}: the zstd body does not decompress ({exc})") from None
    return b"".join(out)
