"""State dict -> manifest + chunks -> tensors: bit-exact for every dtype and layout."""

from __future__ import annotations

import random

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.codec import (
    MAX_CHUNK_BYTES,
    ChunkCorrupted,
    UnsupportedDType,
    WeightAssembler,
    assemble,
    encode_state_dict,
)
from flywheel.codec.encoder import GRPC_DEFAULT_MAX_MESSAGE_BYTES, MAX_NAME_BYTES
from flywheel.common.v1 import common_pb2
from tests.unit.codec.codec_helpers import bits, random_tensor, same_bits, state_dicts

CHUNK_SIZES = st.sampled_from([1, 3, 7, 64, 1000, 1 << 20])
BUCKET_SIZES = st.sampled_from([1, 16, 100, 5000, 256 << 20])


def poisoned_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous destination tensors of the right kind, holding other bits."""
    return {k: random_tensor(v.dtype, tuple(v.shape), seed=12345) for k, v in state.items()}


@settings(max_examples=100, deadline=None)
@given(state=state_dicts(), chunk=CHUNK_SIZES, bucket=BUCKET_SIZES, version=st.integers(1, 2**40))
def test_round_trip_into_destination_is_bit_exact(
    state: dict[str, torch.Tensor], chunk: int, bucket: int, version: int
) -> None:
    enc = encode_state_dict(state, version, chunk_bytes=chunk, bucket_bytes=bucket)
    dest = poisoned_like(state)
    # Through serialized bytes, as over gRPC.
    manifest = common_pb2.WeightManifest.FromString(enc.manifest.SerializeToString())
    chunks = (common_pb2.WeightChunk.FromString(c.SerializeToString()) for c in enc.chunks())
    out = assemble(manifest, chunks, dest)
    assert out.keys() == state.keys()
    for name, t in state.items():
        assert out[name] is dest[name]
        assert same_bits(dest[name], t), name


@settings(max_examples=50, deadline=None)
@given(state=state_dicts(), chunk=CHUNK_SIZES, bucket=BUCKET_SIZES)
def test_round_trip_without_destination_allocates(state: dict[str, torch.Tensor], chunk: int, bucket: int) -> None:
    enc = encode_state_dict(state, 1, chunk_bytes=chunk, bucket_bytes=bucket)
    out = assemble(enc.manifest, enc.chunks())
    assert list(out) == list(state)
    for name, t in state.items():
        assert same_bits(out[name], t), name


@settings(max_examples=60, deadline=None)
@given(state=state_dicts(), chunk=CHUNK_SIZES, bucket=BUCKET_SIZES)
def test_chunk_stream_follows_the_wire_format(state: dict[str, torch.Tensor], chunk: int, bucket: int) -> None:
    enc = encode_state_dict(state, 9, base_version=4, chunk_bytes=chunk, bucket_bytes=bucket)
    m = enc.manifest
    chunks = list(enc.chunks())
    assert len(chunks) == m.chunk_count == enc.chunk_count
    assert m.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert [t.name for t in m.tensors] == list(state)
    seen: dict[str, bytearray] = {name: bytearray() for name in state}
    for seq, c in enumerate(chunks):
        assert c.sequence == seq and c.last == (seq == len(chunks) - 1)
        assert (c.version, c.base_version) == (9, 4)
        assert len(c.data) <= chunk and c.checksum == xxhash.xxh3_64_intdigest(c.data)
        assert c.offset == len(seen[c.tensor_name])  # in order, one tensor per chunk
        seen[c.tensor_name] += c.data
        assert list(c.shape) == list(state[c.tensor_name].shape)
    for name, t in state.items():
        assert bytes(seen[name]) == bits(t).numpy().tobytes()
    buckets = [c.bucket_index for c in chunks]
    assert buckets == sorted(buckets)
    # chunks() replays identically (a synchronizer serves one version many times)
    assert [c.SerializeToString() for c in enc.chunks()] == [c.SerializeToString() for c in chunks]


def test_reordering_within_a_bucket_is_accepted() -> None:
    state = {f"w{i}": random_tensor(torch.bfloat16, (16, 8), seed=i) for i in range(6)}
    enc = encode_state_dict(state, 1, chunk_bytes=32, bucket_bytes=512)  # 2 tensors per bucket
    chunks = list(enc.chunks())
    rng = random.Random(0)
    shuffled = []
    for b in sorted({c.bucket_index for c in chunks}):
        group = [c for c in chunks if c.bucket_index == b]
        rng.shuffle(group)
        shuffled += group
    assert [c.sequence for c in shuffled] != [c.sequence for c in chunks]
    asm = WeightAssembler(enc.manifest, poisoned_like(state))
    progress = []
    for c in shuffled:
        asm.add(c)
        progress.append(asm.complete_buckets)
    assert progress == sorted(progress) and progress[-1] == 3 and asm.complete
    out = asm.commit()
    assert all(same_bits(out[k], v) for k, v in state.items())


def test_staging_is_reusable_across_versions_and_never_aliases_destination() -> None:
    v1 = {"a": random_tensor(torch.float16, (33,), 1), "b": random_tensor(torch.int64, (4, 2), 2)}
    v2 = {"a": random_tensor(torch.float16, (33,), 3), "b": random_tensor(torch.int64, (4, 2), 4)}
    dest = poisoned_like(v1)
    asm = WeightAssembler(encode_state_dict(v1, 1, chunk_bytes=10).manifest, dest)
    for c in encode_state_dict(v1, 1, chunk_bytes=10).chunks():
        asm.add(c)
    asm.commit()
    staging = asm.staging
    enc2 = encode_state_dict(v2, 2, chunk_bytes=10)
    assemble(enc2.manifest, enc2.chunks(), dest, staging=staging)
    assert all(same_bits(dest[k], v2[k]) for k in v2)
    with pytest.raises(ValueError, match="shares memory"):
        WeightAssembler(enc2.manifest, dest, staging=dest)


def test_largest_chunk_fits_grpc_default_message_limit() -> None:
    name = "n" * MAX_NAME_BYTES
    t = torch.zeros(MAX_CHUNK_BYTES + 5, dtype=torch.uint8).reshape(1, 1, 1, -1)
    chunk = next(encode_state_dict({name: t}, 2**63, 2**63 - 1, chunk_bytes=MAX_CHUNK_BYTES).chunks())
    assert len(chunk.data) == MAX_CHUNK_BYTES
    assert chunk.ByteSize() < GRPC_DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.parametrize("chunk_bytes", [0, MAX_CHUNK_BYTES + 1])
def test_encoder_rejects_chunk_sizes_over_the_grpc_limit(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_state_dict({"a": torch.ones(1)}, 1, chunk_bytes=chunk_bytes)


def test_encoder_rejects_bad_versions_and_dtypes() -> None:
    with pytest.raises(ValueError, match="version"):
        encode_state_dict({"a": torch.ones(1)}, 0)
    with pytest.raises(ValueError, match="base_version"):
        encode_state_dict({"a": torch.ones(1)}, 3, base_version=3)
    with pytest.raises(UnsupportedDType, match="complex64"):
        encode_state_dict({"a": torch.ones(2, dtype=torch.complex64)}, 1)


def test_empty_state_dict_round_trips() -> None:
    enc = encode_state_dict({}, 1)
    assert enc.manifest.chunk_count == 0 and list(enc.chunks()) == []
    assert assemble(enc.manifest, []) == {}


def test_source_mutated_after_encoding_is_caught_not_accepted() -> None:
    state = {"w": torch.zeros(64)}
    enc = encode_state_dict(state, 1, chunk_bytes=64)
    dest = {"w": torch.full((64,), 7.0)}
    state["w"][3] = 1.0  # e.g. an optimizer step raced the transfer
    with pytest.raises(ChunkCorrupted):
        assemble(enc.manifest, enc.chunks(), dest)
    assert torch.equal(dest["w"], torch.full((64,), 7.0))


def test_manifest_alone_is_available_and_matches() -> None:
    from flywheel.codec import build_manifest

    state = {"a": torch.arange(100, dtype=torch.int32), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
    assert build_manifest(state, 3, chunk_bytes=64) == encode_state_dict(state, 3, chunk_bytes=64).manifest


def test_module_parameters_and_state_dict_views_as_destination() -> None:
    src = torch.nn.Linear(8, 4).to(torch.bfloat16)
    dst = torch.nn.Linear(8, 4).to(torch.bfloat16)
    enc = encode_state_dict(src.state_dict(), 1, chunk_bytes=16)
    assemble(enc.manifest, enc.chunks(), dst.state_dict())  # detached views share the parameters' memory
    assert same_bits(dst.weight.detach(), src.weight.detach()) and same_bits(dst.bias.detach(), src.bias.detach())
    params = dict(torch.nn.Linear(8, 4).to(torch.bfloat16).named_parameters())
    assemble(enc.manifest, enc.chunks(), params)  # requires_grad leaves
    assert same_bits(params["weight"].detach(), src.weight.detach())
    assert params["weight"].requires_grad


def test_non_contiguous_destination_is_filled_in_logical_order() -> None:
    state = {"m": random_tensor(torch.float16, (3, 5), 1)}
    backing = torch.zeros(5, 3, dtype=torch.float16)
    dest = {"m": backing.t()}  # shape (3, 5), column-major memory
    enc = encode_state_dict(state, 1, chunk_bytes=7)
    assemble(enc.manifest, enc.chunks(), dest)
    assert same_bits(dest["m"], state["m"]) and same_bits(backing, state["m"].t())
