"""Staging in the background (`stage_in_background=True`): same results, same
rejections, with the byte work on the codec's pool.

The corruption suite (test_codec_corruption.py) runs every case in this mode
too; here: versions large enough for several background batches, a corrupt
chunk found while later chunks are still arriving, and the wire-bytes path,
which stays synchronous because its buffer may be reused.
"""

from __future__ import annotations

import time

import pytest
import torch

from flywheel.codec import AssemblerClosed, ChunkCorrupted, WeightAssembler, encode_state_dict
from flywheel.codec.parallel import PIECE_BYTES, codec_pool
from flywheel.common.v1 import common_pb2
from tests.unit.codec.codec_helpers import bits, random_tensor

MiB = 1 << 20

pytestmark = pytest.mark.skipif(codec_pool() is None, reason="one core: background staging is off")

# 25 MiB in 1 MiB chunks: several background batches of PIECE_BYTES.
STATE = {
    "a": random_tensor(torch.bfloat16, (6 * MiB,), 1),
    "b": random_tensor(torch.float32, (2 * MiB + 3,), 2),
    "c": random_tensor(torch.int8, (5 * MiB + 1,), 3),
    "d": random_tensor(torch.float16, (7,), 4),
    "e": random_tensor(torch.float32, (), 5),
}


def fresh_dest() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in STATE.items()}


def test_the_state_is_several_batches() -> None:
    assert sum(t.numel() * t.element_size() for t in STATE.values()) > 3 * PIECE_BYTES


@pytest.mark.parametrize("feed", ["messages", "pieces"])
def test_round_trip_is_bit_exact(feed: str) -> None:
    enc = encode_state_dict(STATE, 3, chunk_bytes=MiB)
    dest = fresh_dest()
    asm = WeightAssembler(enc.manifest, dest, stage_in_background=True)
    if feed == "messages":
        for chunk in enc.chunks():
            asm.add(chunk)
    else:
        for header, payload in enc.pieces():
            asm.add_piece(header, payload)
    assert asm.commit() is not None
    assert all(torch.equal(bits(dest[k]), bits(v)) for k, v in STATE.items())


def test_a_corrupt_chunk_fails_before_commit_and_stops_all_staging() -> None:
    enc = encode_state_dict(STATE, 3, chunk_bytes=MiB)
    chunks = list(enc.chunks())
    bad = common_pb2.WeightChunk()
    bad.CopyFrom(chunks[2])
    data = bytearray(bad.data)
    data[100] ^= 0x01
    bad.data = bytes(data)
    chunks[2] = bad
    dest = fresh_dest()
    asm = WeightAssembler(enc.manifest, dest, stage_in_background=True)
    with pytest.raises(ChunkCorrupted, match="chunk 2 "):
        for chunk in chunks:
            asm.add(chunk)
        asm.commit()
    staged = {k: bits(v).clone() for k, v in asm.staging.items()}
    time.sleep(0.05)
    assert all(torch.equal(bits(asm.staging[k]), staged[k]) for k in staged), "staging written after the failure"
    assert all(not bits(v).any() for v in dest.values())
    with pytest.raises(AssemblerClosed, match="ChunkCorrupted"):
        asm.commit()


def test_wire_bytes_are_checked_on_the_callers_thread() -> None:
    enc = encode_state_dict(STATE, 3, chunk_bytes=MiB)
    raw = list(enc.serialized_chunks())
    asm = WeightAssembler(enc.manifest, fresh_dest(), stage_in_background=True)
    asm.add_serialized(raw[0])
    corrupt = bytearray(raw[1])
    corrupt[-5] ^= 0x40  # inside the payload (the data field comes last)
    with pytest.raises(ChunkCorrupted, match="chunk 1 "):
        asm.add_serialized(corrupt)
