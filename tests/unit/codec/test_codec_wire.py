"""Serialized chunks: the same WeightChunk bytes, fewer copies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.codec import ChunkCorrupted, CodecError, WeightAssembler, encode_state_dict
from flywheel.codec.wire import parse_chunk, serialize_chunk
from flywheel.common.v1 import common_pb2
from flywheel.varint import LEN, VarintError, WireError, encode_varint, field_key, iter_fields, read_varint
from tests.unit.codec.codec_helpers import bits, random_tensor, same_bits, state_dicts

STATE = {
    "w": random_tensor(torch.bfloat16, (40, 7), 1),
    "b": random_tensor(torch.float8_e5m2, (0,), 2),
    "s": random_tensor(torch.float64, (), 3),
}


@settings(max_examples=60, deadline=None)
@given(state=state_dicts(), chunk=st.sampled_from([1, 5, 64, 4096]))
def test_serialized_chunks_are_the_same_messages(state: dict[str, torch.Tensor], chunk: int) -> None:
    enc = encode_state_dict(state, 3, 2, chunk_bytes=chunk, bucket_bytes=100)
    messages = list(enc.chunks())
    wire = list(enc.serialized_chunks())
    assert [common_pb2.WeightChunk.FromString(w) for w in wire] == messages
    dest = {k: random_tensor(v.dtype, tuple(v.shape), 7) for k, v in state.items()}
    asm = WeightAssembler(enc.manifest, dest)
    for w in wire:
        asm.add_serialized(w)
    asm.commit()
    assert all(same_bits(dest[k], v) for k, v in state.items())


def test_parse_accepts_protobufs_own_encoding_and_mixed_streams() -> None:
    enc = encode_state_dict(STATE, 1, chunk_bytes=100)
    asm = WeightAssembler(enc.manifest)
    for i, chunk in enumerate(enc.chunks()):
        raw = chunk.SerializeToString()  # data in the middle, not last
        header, payload = parse_chunk(raw)
        assert bytes(payload) == chunk.data and header.data == b""
        header.data = bytes(payload)
        assert header == chunk
        asm.add_serialized(raw) if i % 2 else asm.add(chunk)
    out = asm.commit()
    assert all(same_bits(out[k], v) for k, v in STATE.items())


def test_last_data_field_wins_as_in_protobuf() -> None:
    header = common_pb2.WeightChunk(tensor_name="x", offset=3)
    raw = serialize_chunk(header, b"first") + serialize_chunk(common_pb2.WeightChunk(), b"second")
    parsed, payload = parse_chunk(raw)
    reference = common_pb2.WeightChunk.FromString(raw)
    assert bytes(payload) == reference.data == b"second"
    assert parsed.tensor_name == "x" and parsed.offset == 3


def test_serialize_refuses_a_header_with_data() -> None:
    with pytest.raises(ValueError):
        serialize_chunk(common_pb2.WeightChunk(data=b"x"), b"y")


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, 400), flip=st.integers(0, 10_000))
def test_mangled_wire_bytes_raise_codec_errors_only(cut: int, flip: int) -> None:
    enc = encode_state_dict(STATE, 1, chunk_bytes=256)
    raw = bytearray(next(enc.serialized_chunks()))
    raw[flip % len(raw)] ^= 0x5A
    dest = {k: torch.zeros_like(v) for k, v in STATE.items()}
    asm = WeightAssembler(enc.manifest, dest)
    try:
        asm.add_serialized(bytes(raw[: len(raw) - cut % len(raw)]))
        asm.commit()
    except CodecError:
        pass
    else:
        pytest.fail("mangled chunk was accepted")
    assert all(not bits(v).any() for v in dest.values())


def test_truncated_varint_is_data_loss() -> None:
    with pytest.raises(ChunkCorrupted, match="not a valid serialized WeightChunk") as info:
        parse_chunk(b"\x08\xff")
    assert info.value.code == "DATA_LOSS"


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_varints_read_back_what_was_written(n: int) -> None:
    data = b"\x01" + encode_varint(n) + b"\x02"
    assert read_varint(data, 1) == (n, len(data) - 1)
    assert read_varint(memoryview(data), 1) == (n, len(data) - 1)


@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff", b"\xff" * 10 + b"\x01"])
def test_a_truncated_or_overlong_varint_is_an_error(data: bytes) -> None:
    with pytest.raises(VarintError):
        read_varint(data, 0)


def test_pieces_are_headers_plus_payload_views() -> None:
    enc = encode_state_dict(STATE, 2, chunk_bytes=64)
    rebuilt = []
    for header, payload in enc.pieces():
        assert header.data == b"" and isinstance(payload, memoryview)
        header.data = bytes(payload)
        rebuilt.append(header)
    assert rebuilt == list(enc.chunks())


def test_iter_fields_walks_a_message_and_refuses_what_is_not_one() -> None:
    raw = common_pb2.WeightChunk(tensor_name="w", offset=300, data=b"xyz").SerializeToString()
    fields = {number: (wire_type, bytes(raw[value:end])) for number, wire_type, _, value, end in iter_fields(raw)}
    assert fields[7] == (LEN, b"xyz") and fields[3] == (LEN, b"w") and fields[6] == (0, encode_varint(300))
    for bad in (raw[:-1], field_key(1, 3), bytes([0x08, 0x80])):
        with pytest.raises(WireError):
            list(iter_fields(bad))
