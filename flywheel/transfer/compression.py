"""Chunk payloads compressed for a slow link (`PullWeightsRequest.compress`).

A reader far from the synchronizer can ask for every chunk's payload as one
zstd frame (`WeightChunk.zstd`); its checksum stays that of the payload
itself, so the reader checks what it decompressed exactly as it checks a
plain chunk. Level 1: on two cores it compresses and decompresses bfloat16
weights at about 850 MB/s each and saves about 22 % of them (float32: 9 %), so it pays
only below roughly 100 MB/s (bfloat16; 40 MB/s for float32): a far link, not
a LAN or the same host (see "Far replicas" in docs/architecture.md).
"""

from __future__ import annotations

import zstandard

from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss
from flywheel.transfer.frames import chunk_frame, split_frame

LEVEL = 1


def compressed_frame(frame: bytes) -> bytes:
    """A chunk frame with its payload as one zstd frame (an empty payload stays as it is)."""
    header, payload = parse_chunk(split_frame(frame)[1])
    if not len(payload):
        return frame
    header.zstd = True
    return chunk_frame(header, zstandard.ZstdCompressor(level=LEVEL).compress(payload))


def decompressed(header: common_pb2.WeightChunk, payload: bytes | memoryview, limit: int) -> bytes:
    """The payload of a compressed chunk, at most `limit` bytes (the manifest's chunk size)."""
    where = f"chunk {header.sequence} of version {header.version}"
    try:
        # A frame states its size: a larger one than a chunk holds is refused before anything is allocated.
        stated = zstandard.frame_content_size(payload)
        if stated > limit:
            raise DataLoss(f"{where}: its zstd frame holds {stated} bytes, a chunk at most {limit}")
        data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise DataLoss(f"{where}: its zstd frame is corrupt: {exc}") from None
    if len(data) > limit:
        raise DataLoss(f"{where}: {len(data)} bytes decompressed, a chunk holds at most {limit}")
    return data
