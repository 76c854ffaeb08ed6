"""Weight codec: state dicts <-> `WeightManifest` + `WeightChunk` streams.

Domain code (no grpc): the MEMORY sync path and anything else that moves
tensors as protobuf use it; transports only forward the messages.

Wire format of one weight version
---------------------------------
One `WeightManifest`, then exactly `chunk_count` `WeightChunk` messages.

* Tensors travel in the manifest's order, as row-major little-endian bytes
  (bf16/fp8 as their bit patterns). Each chunk carries bytes of exactly one
  tensor: `data` = bytes [offset, offset + len(data)) of that tensor, plus its
  name, dtype and shape, the version, `checksum` = XXH3-64 (seed 0) of `data`,
  `bucket_index`, `sequence` (0-based position in the stream) and `last` (set
  on sequence chunk_count - 1 only).
* Layout (a pure function of the manifest, recomputed and enforced by the
  receiver): each tensor is cut into ceil(nbytes / chunk_bytes) chunks of
  chunk_bytes, the last shorter; a 0-byte tensor has one empty chunk. Buckets
  pack consecutive tensors greedily: a tensor opens a new bucket when it would
  push a non-empty bucket past bucket_bytes (so a tensor bigger than
  bucket_bytes is a bucket of its own).
* Digest: XXH3-128 (seed 0; 16 bytes, canonical big-endian) over
  (1) the header: version, base_version, total_bytes, chunk_count,
      chunk_bytes, bucket_bytes as little-endian u64;
  (2) per tensor: u32 name length, UTF-8 name, u32 DType, u32 ndim, ndim x i64;
  (3) per chunk in sequence order: u32 tensor index, u32 bucket index,
      u64 offset, u64 length, u64 checksum.
  So it binds every chunk's metadata and checksum, in order, to the manifest.
* Identity (`flywheel.codec.identity`): what the weights are, independent of
  this transfer's layout: each TensorMeta carries its tensor's digest and the
  manifest the version's (`identity`); with 1 MiB chunks the receiver checks
  every tensor digest from the chunk checksums.
* Ordering tolerance: chunks of the current bucket (the lowest one with
  chunks missing) may arrive in any order; a later bucket's chunk before that
  is an error.

Use
---
    enc = encode_state_dict(model.state_dict(), version=7)
    send(enc.manifest); for c in enc.chunks(): send(c)

    asm = WeightAssembler(manifest, destination=model.state_dict())
    for c in stream: asm.add(c)
    asm.commit()      # all or nothing: the destination is untouched on error

A transport that forwards serialized messages as-is (gRPC handlers without
(de)serializers) can use `enc.serialized_chunks()` and `asm.add_serialized`
instead: the same WeightChunk bytes, minus two payload copies per side that
protobuf message objects cost (see `flywheel.codec.wire`).

Cost per byte: the sender hashes the tensors once (parallel, up front) and
copies each chunk once (twice as a message object); the receiver hashes each
chunk, copies it into staging, and at commit copies staging into the
destination (parallel; skipped when there is no destination: the staging
tensors are handed over). bench/codec.py measures it against memcpy and a TCP
loopback transfer.

Errors all derive from `CodecError` (see `flywheel.codec.errors`), each
carrying the gRPC status name in `code` (DATA_LOSS / INVALID_ARGUMENT).
"""

from flywheel.codec.checker import ChunkChecker
from flywheel.codec.decoder import WeightAssembler, assemble, check_tensors_match
from flywheel.codec.dtypes import (
    SUPPORTED_DTYPES,
    dtype_from_proto,
    dtype_to_proto,
    element_size,
    tensor_from_proto,
    tensor_to_proto,
)
from flywheel.codec.encoder import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    EncodedVersion,
    build_manifest,
    encode_state_dict,
)
from flywheel.codec.errors import (
    AssemblerClosed,
    ChunkCorrupted,
    ChunkDuplicated,
    ChunkMissing,
    ChunkOutOfOrder,
    CodecError,
    DigestMismatch,
    InvalidManifest,
    InvalidTensor,
    ManifestMismatch,
    StreamTruncated,
    UnsupportedDType,
)
from flywheel.codec.identity import VersionIdentity, identify, manifest_identity
from flywheel.codec.wire import parse_chunk, serialize_chunk

__all__ = [
    "ChunkChecker",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "SUPPORTED_DTYPES",
    "AssemblerClosed",
    "ChunkCorrupted",
    "ChunkDuplicated",
    "ChunkMissing",
    "ChunkOutOfOrder",
    "CodecError",
    "DigestMismatch",
    "EncodedVersion",
    "InvalidManifest",
    "InvalidTensor",
    "ManifestMismatch",
    "StreamTruncated",
    "UnsupportedDType",
    "VersionIdentity",
    "WeightAssembler",
    "assemble",
    "build_manifest",
    "check_tensors_match",
    "dtype_from_proto",
    "dtype_to_proto",
    "element_size",
    "encode_state_dict",
    "identify",
    "manifest_identity",
    "parse_chunk",
    "serialize_chunk",
    "tensor_from_proto",
    "tensor_to_proto",
]
