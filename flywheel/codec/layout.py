"""The chunk layout of a weight version and its digest, shared by both ends.

The layout is a pure function of the manifest (tensor sizes in stream order,
chunk_bytes, bucket_bytes), so a receiver recomputes the exact chunk plan the
sender used and checks every arriving chunk against it: no interval
bookkeeping, and overlaps or gaps are impossible by construction.

Rules (part of the wire format, see `flywheel.codec`):
  * Buckets: tensors in stream order are packed greedily; a tensor starts a
    new bucket when adding it would push a non-empty bucket past bucket_bytes.
    So a bucket holds at most bucket_bytes unless it is a single larger tensor.
  * Chunks: each tensor is cut into ceil(nbytes / chunk_bytes) chunks of
    chunk_bytes (the last one shorter); a 0-byte tensor has one empty chunk, so
    every tensor appears in the stream.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from flywheel.codec.dtypes import dtype_from_proto, dtype_name, expected_nbytes
from flywheel.codec.errors import InvalidManifest, InvalidTensor, UnsupportedDType
from flywheel.codec.identity import IDENTITY_BYTES, version_digest
from flywheel.common.v1 import common_pb2

#: 32-byte little-endian record per chunk in the digest (see `compute_digest`).
CHUNK_RECORD = np.dtype(
    [("tensor_index", "<u4"), ("bucket_index", "<u4"), ("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8")]
)
DIGEST_BYTES = 16


@dataclass(frozen=True)
class TensorEntry:
    """One manifest tensor, validated: wire dtype, shape and byte size."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ChunkPlan:
    """Per-chunk arrays in sequence order (all of length `count`)."""

    tensor_index: np.ndarray
    bucket_index: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    #: Number of chunks in each bucket.
    bucket_chunk_counts: np.ndarray
    #: Chunks of tensor i are sequences [tensor_bounds[i], tensor_bounds[i + 1]).
    tensor_bounds: np.ndarray

    @property
    def count(self) -> int:
        return int(self.tensor_index.shape[0])


def assign_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """Bucket index of every tensor (greedy packing in stream order)."""
    buckets: list[int] = []
    current, filled = 0, 0
    for n in nbytes:
        if filled > 0 and filled + n > bucket_bytes:
            current, filled = current + 1, 0
        buckets.append(current)
        filled += n
    return buckets


def plan_chunks(nbytes: Sequence[int], chunk_bytes: int, bucket_bytes: int) -> ChunkPlan:
    """The chunk plan of tensors with these byte sizes (vectorised: 10^5 chunks in ms)."""
    if chunk_bytes <= 0 or bucket_bytes <= 0:
        raise InvalidManifest(f"chunk_bytes ({chunk_bytes}) and bucket_bytes ({bucket_bytes}) must be positive")
    sizes = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    per_tensor = np.maximum(1, -(-sizes // chunk_bytes))
    count = int(per_tensor.sum())
    tensor_index = np.repeat(np.arange(len(sizes), dtype=np.int64), per_tensor)
    first_seq = np.cumsum(per_tensor) - per_tensor
    offset = (np.arange(count, dtype=np.int64) - first_seq[tensor_index]) * chunk_bytes
    length = np.minimum(chunk_bytes, sizes[tensor_index] - offset)
    buckets = np.asarray(assign_buckets(sizes.tolist(), bucket_bytes), dtype=np.int64)
    bucket_index = buckets[tensor_index]
    n_buckets = int(buckets[-1]) + 1 if len(buckets) else 0
    return ChunkPlan(
        tensor_index=tensor_index.astype(np.uint32),
        bucket_index=bucket_index.astype(np.uint32),
        offset=offset.astype(np.uint64),
        length=length.astype(np.uint64),
        bucket_chunk_counts=np.bincount(bucket_index, minlength=n_buckets).astype(np.int64),
        tensor_bounds=np.concatenate([[0], np.cumsum(per_tensor)]).astype(np.int64),
    )


def _header(manifest: common_pb2.WeightManifest) -> bytes:
    return struct.pack(
        "<6Q",
        manifest.version,
        manifest.base_version,
        manifest.total_bytes,
        manifest.chunk_count,
        manifest.chunk_bytes,
        manifest.bucket_bytes,
    )


def _tensor_table(entries: Sequence[TensorEntry]) -> bytes:
    parts: list[bytes] = []
    for e in entries:
        name = e.name.encode("utf-8")
        parts.append(struct.pack(f"<I{len(name)}sII{len(e.shape)}q", len(name), name, e.dtype, len(e.shape), *e.shape))
    return b"".join(parts)


def compute_digest(
    manifest: common_pb2.WeightManifest,
    entries: Sequence[TensorEntry],
    plan: ChunkPlan,
    checksums: np.ndarray,
) -> bytes:
    """XXH3-128 (seed 0, canonical big-endian 16 bytes) over, in order:

    1. header: version, base_version, total_bytes, chunk_count, chunk_bytes,
       bucket_bytes as little-endian u64;
    2. per tensor in stream order: u32 name length, UTF-8 name, u32 DType,
       u32 ndim, ndim x i64 dims;
    3. per chunk in sequence order: u32 tensor index, u32 bucket index,
       u64 offset, u64 length, u64 XXH3-64 checksum (`CHUNK_RECORD`).

    The manifest's own digest field is not part of it.
    """
    records = np.empty(plan.count, dtype=CHUNK_RECORD)
    records["tensor_index"] = plan.tensor_index
    records["bucket_index"] = plan.bucket_index
    records["offset"] = plan.offset
    records["length"] = plan.length
    records["checksum"] = checksums
    h = xxhash.xxh3_128()
    h.update(_header(manifest))
    h.update(_tensor_table(entries))
    h.update(records.view(np.uint8))
    return h.digest()


def manifest_entries(manifest: common_pb2.WeightManifest) -> list[TensorEntry]:
    """Validated tensor entries of a manifest (does not check chunk counts)."""
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    for i, meta in enumerate(manifest.tensors):
        if not meta.name:
            raise InvalidManifest(f"manifest tensor #{i} has an empty name")
        if meta.name in seen:
            raise InvalidManifest(f"manifest lists tensor {meta.name!r} twice")
        seen.add(meta.name)
        try:
            dtype_from_proto(meta.dtype)
            nbytes = expected_nbytes(meta.dtype, list(meta.shape), f"tensor {meta.name!r}")
        except (UnsupportedDType, InvalidTensor) as exc:
            raise InvalidManifest(f"manifest tensor {meta.name!r}: {exc}") from None
        if meta.nbytes != nbytes:
            raise InvalidManifest(
                f"manifest tensor {meta.name!r}: nbytes {meta.nbytes} but "
                f"{dtype_name(meta.dtype)}{list(meta.shape)} is {nbytes} bytes"
            )
        entries.append(TensorEntry(meta.name, meta.dtype, tuple(meta.shape), nbytes))
    return entries


def check_identity_fields(manifest: common_pb2.WeightManifest) -> None:
    """The identity fields are well formed, and the version's identity is its tensors'.

    Both may be absent (a manifest written before identities); a manifest
    with every tensor digest but a wrong version identity is refused."""
    if manifest.identity and len(manifest.identity) != IDENTITY_BYTES:
        raise InvalidManifest(f"identity is {len(manifest.identity)} bytes, XXH3-128 needs {IDENTITY_BYTES}")
    digests = {}
    for meta in manifest.tensors:
        if meta.digest and len(meta.digest) != IDENTITY_BYTES:
            raise InvalidManifest(f"tensor {meta.name!r}: digest is {len(meta.digest)} bytes, needs {IDENTITY_BYTES}")
        digests[meta.name] = meta.digest
    if manifest.identity and all(digests.values()) and version_digest(digests) != manifest.identity:
        raise InvalidManifest("identity does not match the tensors' digests")


def validate_manifest(manifest: common_pb2.WeightManifest) -> tuple[list[TensorEntry], ChunkPlan]:
    """Check a manifest is self-consistent; return its entries and chunk plan."""
    if manifest.checksum_algorithm != common_pb2.CHECKSUM_ALGORITHM_XXH3:
        raise InvalidManifest(
            f"checksum_algorithm {manifest.checksum_algorithm} is not supported (only CHECKSUM_ALGORITHM_XXH3)"
        )
    if len(manifest.digest) != DIGEST_BYTES:
        raise InvalidManifest(f"digest is {len(manifest.digest)} bytes, XXH3-128 needs {DIGEST_BYTES}")
    entries = manifest_entries(manifest)
    check_identity_fields(manifest)
    total = sum(e.nbytes for e in entries)
    if manifest.total_bytes != total:
        raise InvalidManifest(f"total_bytes {manifest.total_bytes} but the tensors add up to {total}")
    plan = plan_chunks([e.nbytes for e in entries], manifest.chunk_bytes, manifest.bucket_bytes)
    if manifest.chunk_count != plan.count:
        raise InvalidManifest(
            f"chunk_count {manifest.chunk_count} but the layout of these tensors with chunk_bytes "
            f"{manifest.chunk_bytes} has {plan.count} chunks"
        )
    return entries, plan
