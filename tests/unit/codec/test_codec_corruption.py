"""Every way a version can arrive broken is rejected with a clear error, and
the destination tensors stay bit-identical."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.codec import (
    AssemblerClosed,
    ChunkCorrupted,
    ChunkDuplicated,
    ChunkMissing,
    ChunkOutOfOrder,
    CodecError,
    DigestMismatch,
    EncodedVersion,
    InvalidManifest,
    ManifestMismatch,
    StreamTruncated,
    WeightAssembler,
    assemble,
    encode_state_dict,
)
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FlywheelError, InvalidArgument
from tests.unit.codec.codec_helpers import bits, random_tensor

Chunks = list[common_pb2.WeightChunk]

# Four buckets of 1-3 tensors, several dtypes; 64-byte chunks.
STATE = {
    "embed": random_tensor(torch.bfloat16, (8, 16), 1),  # 256 B: bucket 0
    "norm": random_tensor(torch.float32, (16,), 2),  # 64 B: bucket 1
    "bias": random_tensor(torch.float8_e4m3fn, (40,), 3),  # 40 B: bucket 1
    "proj": random_tensor(torch.float16, (10, 10), 4),  # 200 B: bucket 2
    "step": random_tensor(torch.int64, (), 5),  # 8 B: bucket 3
    "mask": random_tensor(torch.bool, (0, 3), 6),  # 0 B: bucket 3
}


_MODE = {"stage_in_background": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["inline", "background"])
def staging_mode(request: pytest.FixtureRequest) -> None:
    """Every case runs twice: chunks staged on the caller's thread, and on the codec's pool."""
    _MODE["stage_in_background"] = request.param


@pytest.fixture
def enc() -> EncodedVersion:
    e = encode_state_dict(STATE, 5, chunk_bytes=64, bucket_bytes=128)
    assert sorted({c.bucket_index for c in e.chunks()}) == [0, 1, 2, 3]
    return e


@pytest.fixture
def dest() -> dict[str, torch.Tensor]:
    return {k: random_tensor(v.dtype, tuple(v.shape), seed=99) for k, v in STATE.items()}


def copy(c: common_pb2.WeightChunk) -> common_pb2.WeightChunk:
    out = common_pb2.WeightChunk()
    out.CopyFrom(c)
    return out


def rejected(
    enc: EncodedVersion,
    dest: dict[str, torch.Tensor],
    tamper: Callable[[Chunks], Chunks],
    error: type[CodecError],
    match: str,
    manifest: common_pb2.WeightManifest | None = None,
) -> CodecError:
    """Feed the tampered stream; assert the error and that dest is untouched."""
    before = {k: bits(v).clone() for k, v in dest.items()}
    chunks = tamper([copy(c) for c in enc.chunks()])
    with pytest.raises(error, match=match) as info:
        assemble(manifest or enc.manifest, chunks, dest, **_MODE)
    for k, v in dest.items():
        assert torch.equal(bits(v), before[k]), f"destination {k!r} was modified"
    return info.value


def test_positive_control(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    assemble(enc.manifest, enc.chunks(), dest, **_MODE)
    assert all(torch.equal(bits(dest[k]), bits(v)) for k, v in STATE.items())


def test_corrupt_bytes(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def flip(chunks: Chunks) -> Chunks:
        data = bytearray(chunks[7].data)
        data[3] ^= 0x10
        chunks[7].data = bytes(data)
        return chunks

    err = rejected(
        enc, dest, flip, ChunkCorrupted, r"tensor 'proj': chunk 7 \(bytes \[64, 128\)\) does not match its checksum"
    )
    assert err.code == "DATA_LOSS" and isinstance(err, DataLoss) and isinstance(err, FlywheelError)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.integers(0, 20), pos=st.integers(0, 63), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_caught(seq: int, pos: int, bit: int) -> None:
    enc = encode_state_dict(STATE, 5, chunk_bytes=64, bucket_bytes=128)
    dest = {k: torch.zeros_like(v) for k, v in STATE.items()}
    chunks = [copy(c) for c in enc.chunks()]
    target = chunks[seq % len(chunks)]
    if not target.data:
        return
    data = bytearray(target.data)
    data[pos % len(data)] ^= 1 << bit
    target.data = bytes(data)
    with pytest.raises(ChunkCorrupted):
        assemble(enc.manifest, chunks, dest, **_MODE)
    assert all(not bits(v).any() for v in dest.values())


def test_wrong_checksum(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def bad(chunks: Chunks) -> Chunks:
        chunks[0].checksum ^= 1
        return chunks

    rejected(enc, dest, bad, ChunkCorrupted, "chunk 0")


def test_consistently_forged_chunk_fails_the_digest(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def forge(chunks: Chunks) -> Chunks:
        chunks[1].data = bytes(len(chunks[1].data))
        chunks[1].checksum = xxhash.xxh3_64_intdigest(chunks[1].data)
        return chunks

    rejected(enc, dest, forge, DigestMismatch, "digest")


def test_tampered_manifest_digest(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    manifest = common_pb2.WeightManifest()
    manifest.CopyFrom(enc.manifest)
    manifest.digest = bytes(16)
    err = rejected(enc, dest, lambda c: c, DigestMismatch, "version 5", manifest)
    assert err.code == "DATA_LOSS"


def test_missing_chunk_in_last_bucket(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def drop(chunks: Chunks) -> Chunks:
        return [c for c in chunks if c.tensor_name != "step"]

    rejected(enc, dest, drop, ChunkMissing, r"1 of \d+ chunks missing: chunk \d+ \(tensor 'step'")


def test_missing_chunk_in_earlier_bucket_is_noticed_at_the_next_bucket(
    enc: EncodedVersion, dest: dict[str, torch.Tensor]
) -> None:
    rejected(enc, dest, lambda c: c[:2] + c[3:], ChunkOutOfOrder, "bucket 0 still misses 1 chunk")


def test_truncated_stream(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    err = rejected(enc, dest, lambda c: c[:-2], StreamTruncated, "ended before its last chunk")
    assert isinstance(err, ChunkMissing) and err.code == "DATA_LOSS"
    rejected(enc, dest, lambda c: [], StreamTruncated, "chunks missing")


def test_duplicated_chunk(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    rejected(enc, dest, lambda c: c[:3] + [copy(c[2])] + c[3:], ChunkDuplicated, "chunk 2 .*twice")


def test_duplicate_of_an_earlier_bucket(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    rejected(enc, dest, lambda c: c + [copy(c[0])], ChunkDuplicated, "chunk 0")


def test_reordered_beyond_tolerance(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def swap(chunks: Chunks) -> Chunks:
        b1 = next(i for i, c in enumerate(chunks) if c.bucket_index == 1)
        chunks[b1 - 1], chunks[b1] = chunks[b1], chunks[b1 - 1]
        return chunks

    err = rejected(enc, dest, swap, ChunkOutOfOrder, "of bucket 1 arrived while bucket 0")
    assert err.code == "DATA_LOSS"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", common_pb2.DTYPE_FLOAT32, "tensor 'embed': chunk 1 has dtype DTYPE_FLOAT32, manifest DTYPE_BFLOAT16"),
        ("tensor_name", "lm_head", "unknown tensor 'lm_head'"),
        ("tensor_name", "norm", "for tensor 'norm'; the manifest's layout puts 'embed' there"),
        ("offset", 10_000, r"bytes \[10000, 10064\), outside the tensor's 256 bytes"),
        ("offset", 32, r"bytes \[32, 96\) but the manifest's layout has \[64, 128\) .*overlapping"),
        ("version", 6, "version 6 .*manifest is version 5"),
        ("base_version", 1, "base 1"),
        ("sequence", 999, "sequence 999 is beyond"),
        ("bucket_index", 3, "claims bucket 3"),
        ("last", True, "last=True"),
    ],
)
def test_chunk_contradicting_the_manifest(
    enc: EncodedVersion, dest: dict[str, torch.Tensor], field: str, value: object, match: str
) -> None:
    def edit(chunks: Chunks) -> Chunks:
        setattr(chunks[1], field, value)
        return chunks

    err = rejected(enc, dest, edit, ManifestMismatch, match)
    assert err.code == "INVALID_ARGUMENT" and isinstance(err, InvalidArgument)


def test_wrong_shape_in_chunk(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def reshape(chunks: Chunks) -> Chunks:
        del chunks[0].shape[:]
        chunks[0].shape.extend([16, 8])
        return chunks

    rejected(enc, dest, reshape, ManifestMismatch, r"tensor 'embed': chunk 0 has shape \[16, 8\], manifest \[8, 16\]")


def test_short_payload(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    def shorten(chunks: Chunks) -> Chunks:
        chunks[0].data = chunks[0].data[:-1]
        chunks[0].checksum = xxhash.xxh3_64_intdigest(chunks[0].data)
        return chunks

    rejected(enc, dest, shorten, ManifestMismatch, r"\[0, 63\) but the manifest's layout has \[0, 64\)")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"name": "embed", "dtype": torch.float16},
            ManifestMismatch,
            "tensor 'embed': manifest dtype bfloat16, destination dtype float16",
        ),
        (
            {"name": "proj", "shape": (100,)},
            ManifestMismatch,
            r"tensor 'proj': manifest shape \[10, 10\], destination shape \[100\]",
        ),
        ({"drop": "norm"}, ManifestMismatch, "destination tensors do not match the manifest: missing 'norm'"),
        ({"add": "extra"}, ManifestMismatch, "not in the manifest 'extra'"),
    ],
)
def test_destination_mismatch(
    enc: EncodedVersion, dest: dict[str, torch.Tensor], change: dict, error: type[CodecError], match: str
) -> None:
    if "drop" in change:
        del dest[change["drop"]]
    elif "add" in change:
        dest[change["add"]] = torch.zeros(1)
    else:
        old = dest[change["name"]]
        dest[change["name"]] = torch.zeros(change.get("shape", old.shape), dtype=change.get("dtype", old.dtype))
    before = {k: bits(v).clone() for k, v in dest.items()}
    with pytest.raises(error, match=match):
        WeightAssembler(enc.manifest, dest)
    assert all(torch.equal(bits(dest[k]), before[k]) for k in dest)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: setattr(m, "chunk_count", m.chunk_count + 1), "chunk_count"),
        (lambda m: setattr(m, "total_bytes", 1), "total_bytes"),
        (lambda m: setattr(m.tensors[0], "nbytes", 3), "nbytes 3"),
        (lambda m: m.tensors[0].shape.append(-1), "negative"),
        (lambda m: setattr(m.tensors[1], "name", "embed"), "twice"),
        (lambda m: setattr(m.tensors[1], "dtype", 0), "DTYPE_UNSPECIFIED"),
        (lambda m: setattr(m, "checksum_algorithm", 0), "checksum_algorithm"),
        (lambda m: setattr(m, "digest", b"short"), "digest"),
        (lambda m: setattr(m, "chunk_bytes", 0), "chunk_bytes"),
        (lambda m: setattr(m, "version", 0), "version"),
    ],
)
def test_self_contradicting_manifest(enc: EncodedVersion, edit: Callable, match: str) -> None:
    manifest = common_pb2.WeightManifest()
    manifest.CopyFrom(enc.manifest)
    edit(manifest)
    with pytest.raises(InvalidManifest, match=match) as info:
        WeightAssembler(manifest)
    assert info.value.code == "INVALID_ARGUMENT"


def test_failure_after_whole_buckets_landed_still_leaves_destination_alone(
    enc: EncodedVersion, dest: dict[str, torch.Tensor]
) -> None:
    before = {k: bits(v).clone() for k, v in dest.items()}
    asm = WeightAssembler(enc.manifest, dest)
    chunks = list(enc.chunks())
    for c in chunks[:-1]:
        asm.add(c)
    assert asm.complete_buckets == 3 and not asm.complete
    bad = copy(chunks[-1])
    bad.checksum ^= 1
    with pytest.raises(ChunkCorrupted):
        asm.add(bad)
    assert all(torch.equal(bits(dest[k]), before[k]) for k in dest)
    # A failed assembler is spent: the good chunk cannot rescue it.
    with pytest.raises(AssemblerClosed, match="ChunkCorrupted") as info:
        asm.add(chunks[-1])
    assert info.value.code == "FAILED_PRECONDITION"
    with pytest.raises(AssemblerClosed):
        asm.commit()
    assert all(torch.equal(bits(dest[k]), before[k]) for k in dest)


def test_committed_assembler_refuses_more(enc: EncodedVersion, dest: dict[str, torch.Tensor]) -> None:
    asm = WeightAssembler(enc.manifest, dest)
    for c in enc.chunks():
        asm.add(c)
    asm.commit()
    with pytest.raises(AssemblerClosed, match="committed"):
        asm.commit()
    with pytest.raises(AssemblerClosed):
        asm.add(next(enc.chunks()))
