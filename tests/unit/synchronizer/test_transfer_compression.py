"""Compressed chunk frames (flywheel/transfer/compression.py): the payload comes back exactly, a
corrupt or oversized frame is refused as DATA_LOSS, and the checksum stays the payload's."""

from __future__ import annotations

import pytest

from flywheel.codec import encode_state_dict
from flywheel.codec.wire import parse_chunk
from flywheel.errors import DataLoss
from flywheel.transfer.compression import compressed_frame, decompressed
from flywheel.transfer.frames import encoded_frames, split_frame
from tests.unit.synchronizer.sync_helpers import small_state


def _chunks():
    return list(encoded_frames(encode_state_dict(small_state(0, scale=40), 1, chunk_bytes=4096)))[1:]


def test_a_compressed_frame_gives_back_the_payload_with_its_own_checksum() -> None:
    for frame in _chunks():
        plain_header, plain = parse_chunk(split_frame(frame)[1])
        header, payload = parse_chunk(split_frame(compressed_frame(frame))[1])
        assert header.checksum == plain_header.checksum and header.sequence == plain_header.sequence
        if len(plain):
            assert header.zstd and bytes(decompressed(header, payload, 4096)) == bytes(plain)
        else:
            assert not header.zstd  # an empty payload travels as it is


def test_a_corrupt_or_oversized_frame_is_refused() -> None:
    frame = next(f for f in _chunks() if len(parse_chunk(split_frame(f)[1])[1]) == 4096)
    header, payload = parse_chunk(split_frame(compressed_frame(frame))[1])
    with pytest.raises(DataLoss, match="corrupt"):
        decompressed(header, b"\x28\xb5\x2f\xfd" + bytes(payload[4:12]), 4096)
    with pytest.raises(DataLoss):
        decompressed(header, payload, 1024)  # more than a chunk may hold
