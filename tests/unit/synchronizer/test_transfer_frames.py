"""flywheel.transfer.frames: frames are valid push/pull messages, bit for bit."""

from __future__ import annotations

import pytest

from flywheel.codec import encode_state_dict
from flywheel.errors import DataLoss
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import CHUNK_FIELD, MANIFEST_FIELD, encoded_frames, split_frame, wrap_chunk
from flywheel.varint import encode_varint
from tests.unit.synchronizer.sync_helpers import small_state


def test_frames_parse_as_both_push_requests_and_pull_responses() -> None:
    state = small_state()
    encoded = encode_state_dict(state, 4, chunk_bytes=700, bucket_bytes=3000)
    frames = list(encoded_frames(encoded))
    assert len(frames) == encoded.chunk_count + 1
    assert pb.PushWeightsRequest.FromString(frames[0]).manifest == encoded.manifest
    for frame, chunk in zip(frames[1:], encoded.chunks()):
        assert pb.PushWeightsRequest.FromString(frame).chunk == chunk
        assert pb.PullWeightsResponse.FromString(frame).chunk == chunk
        # the generic wrapping gives the same message
        assert pb.PullWeightsResponse.FromString(wrap_chunk(chunk.SerializeToString())).chunk == chunk
    assert split_frame(frames[0])[0] == MANIFEST_FIELD and split_frame(frames[1])[0] == CHUNK_FIELD


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"", "empty"),
        (b"\x1a\x00", "field 3"),
        (b"\x12\x05abc", "5-byte message"),
        (b"\x12\xff", "varint"),
    ],
)
def test_bad_frames_are_data_loss(frame: bytes, message: str) -> None:
    with pytest.raises(DataLoss, match=message):
        split_frame(frame)


def test_varint() -> None:
    assert [encode_varint(n) for n in (0, 127, 128, 300)] == [b"\x00", b"\x7f", b"\x80\x01", b"\xac\x02"]
