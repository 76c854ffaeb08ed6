"""Verification of a pushed weight version without assembling tensors.

The synchronizer never needs the weights themselves, only proof that what it
keeps and serves is exactly what the trainer encoded. `ChunkVerifier` applies
the codec's rules (`flywheel.codec`: layout recomputed from the manifest,
per-chunk XXH3-64, bucket ordering, whole-version XXH3-128 digest) to chunk
headers and payload views, raising the codec's own error classes, so a push
fails here for exactly the reasons a `WeightAssembler` would reject it.
"""

from __future__ import annotations

import numpy as np
import xxhash

from flywheel.codec import (
    ChunkCorrupted,
    ChunkDuplicated,
    ChunkMissing,
    ChunkOutOfOrder,
    DigestMismatch,
    InvalidManifest,
    ManifestMismatch,
    StreamTruncated,
)
from flywheel.codec.layout import compute_digest, validate_manifest
from flywheel.common.v1 import common_pb2


class ChunkVerifier:
    def __init__(self, manifest: common_pb2.WeightManifest) -> None:
        if manifest.version < 1:
            raise InvalidManifest(f"manifest version must be >= 1, got {manifest.version}")
        if manifest.base_version >= manifest.version:
            raise InvalidManifest(f"base_version {manifest.base_version} must be below version {manifest.version}")
        self.manifest = manifest
        self._entries, self._plan = validate_manifest(manifest)
        self.count = self._plan.count
        self._tensor_of = self._plan.tensor_index.tolist()
        self._bucket_of = self._plan.bucket_index.tolist()
        self._offset_of = self._plan.offset.tolist()
        self._length_of = self._plan.length.tolist()
        self._bucket_left = self._plan.bucket_chunk_counts.tolist()
        self._received = bytearray(self.count)
        self._checksums = np.zeros(self.count, dtype=np.uint64)
        self.received = 0
        self._open_bucket = 0
        self._advance()

    def _advance(self) -> None:
        while self._open_bucket < len(self._bucket_left) and self._bucket_left[self._open_bucket] == 0:
            self._open_bucket += 1

    def check(self, chunk: common_pb2.WeightChunk, data: memoryview) -> int:
        """Validates one chunk (header fields + payload view, as
        `flywheel.codec.wire.parse_chunk` returns them) against the layout and
        its checksum; returns its sequence."""
        m, seq = self.manifest, chunk.sequence
        if chunk.version != m.version or chunk.base_version != m.base_version:
            raise ManifestMismatch(
                f"chunk {seq} is for version {chunk.version} (base {chunk.base_version}), "
                f"manifest is version {m.version} (base {m.base_version})"
            )
        if seq >= self.count:
            raise ManifestMismatch(f"chunk sequence {seq} is beyond the version's {self.count} chunks")
        entry = self._entries[self._tensor_of[seq]]
        if chunk.tensor_name != entry.name:
            raise ManifestMismatch(
                f"chunk {seq} is for tensor {chunk.tensor_name!r}; the layout puts {entry.name!r} there"
            )
        if chunk.dtype != entry.dtype or tuple(chunk.shape) != entry.shape:
            raise ManifestMismatch(
                f"tensor {entry.name!r}: chunk {seq} has dtype {chunk.dtype} shape {list(chunk.shape)}, "
                f"manifest dtype {entry.dtype} shape {list(entry.shape)}"
            )
        start, size = chunk.offset, len(data)
        want_start, want_size = self._offset_of[seq], self._length_of[seq]
        if start != want_start or size != want_size:
            raise ManifestMismatch(
                f"tensor {entry.name!r}: chunk {seq} covers bytes [{start}, {start + size}) but the layout "
                f"has [{want_start}, {want_start + want_size}) there"
            )
        bucket = self._bucket_of[seq]
        if chunk.bucket_index != bucket:
            raise ManifestMismatch(
                f"tensor {entry.name!r}: chunk {seq} claims bucket {chunk.bucket_index}, layout says {bucket}"
            )
        if chunk.last != (seq == self.count - 1):
            raise ManifestMismatch(f"chunk {seq} has last={chunk.last}, but the final chunk is {self.count - 1}")
        if self._received[seq]:
            raise ChunkDuplicated(f"tensor {entry.name!r}: chunk {seq} arrived twice")
        if bucket > self._open_bucket:
            raise ChunkOutOfOrder(
                f"tensor {entry.name!r}: chunk {seq} of bucket {bucket} arrived while bucket "
                f"{self._open_bucket} still misses {self._bucket_left[self._open_bucket]} chunk(s)"
            )
        if xxhash.xxh3_64_intdigest(data) != chunk.checksum:
            raise ChunkCorrupted(
                f"tensor {entry.name!r}: chunk {seq} (bytes [{start}, {start + size})) does not match its checksum"
            )
        self._received[seq] = 1
        self._checksums[seq] = chunk.checksum
        self.received += 1
        self._bucket_left[bucket] -= 1
        if bucket == self._open_bucket:
            self._advance()
        return seq

    def finish(self) -> None:
        """StreamTruncated / ChunkMissing / DigestMismatch unless the version is whole and intact."""
        if self.received < self.count:
            missing = self.count - self.received
            v = self.manifest.version
            if not self._received[self.count - 1]:
                raise StreamTruncated(
                    f"version {v}: the push ended before its last chunk ({missing} of {self.count} missing)"
                )
            raise ChunkMissing(f"version {v}: {missing} of {self.count} chunks never arrived")
        digest = compute_digest(self.manifest, self._entries, self._plan, self._checksums)
        if digest != self.manifest.digest:
            raise DigestMismatch(
                f"version {self.manifest.version}: every chunk matched its checksum but the version digest is "
                f"{digest.hex()}, the manifest says {self.manifest.digest.hex()}"
            )
