"""The codec's acceptance rules for one version's chunks, without any tensors.

`ChunkChecker` holds a manifest's layout (see `flywheel.codec.layout`) and
checks each arriving chunk header + payload against it: right version,
sequence, tensor, dtype, shape, byte range, bucket and `last` flag, not seen
before, not ahead of the bucket still being filled, payload matching its
XXH3-64. `finish()` then demands every chunk and the whole-version digest.

Two receivers share it, so they reject a version for exactly the same
reasons: `WeightAssembler` (which also stages the accepted bytes into
tensors) and the synchronizer (which only proves what it keeps and serves is
what the trainer encoded, never building tensors).
"""

from __future__ import annotations

import numpy as np
import xxhash

from flywheel.codec.dtypes import dtype_name
from flywheel.codec.errors import (
    ChunkCorrupted,
    ChunkDuplicated,
    ChunkMissing,
    ChunkOutOfOrder,
    DigestMismatch,
    InvalidManifest,
    ManifestMismatch,
    StreamTruncated,
)
from flywheel.codec.identity import IDENTITY_BLOCK_BYTES, tensor_digest
from flywheel.codec.layout import TensorEntry, compute_digest, validate_manifest
from flywheel.common.v1 import common_pb2


class ChunkChecker:
    """Validates one version's chunks in arrival order; not thread-safe."""

    def __init__(self, manifest: common_pb2.WeightManifest) -> None:
        if manifest.version < 1:
            raise InvalidManifest(f"manifest version must be >= 1, got {manifest.version}")
        if manifest.base_version >= manifest.version:
            raise InvalidManifest(f"base_version {manifest.base_version} must be below version {manifest.version}")
        self.manifest = manifest
        self.entries, self.plan = validate_manifest(manifest)
        self.count = self.plan.count
        self.index = {e.name: i for i, e in enumerate(self.entries)}
        self.tensor_of = self.plan.tensor_index.tolist()
        self._bucket_of = self.plan.bucket_index.tolist()
        self._offset_of = self.plan.offset.tolist()
        self._length_of = self.plan.length.tolist()
        self._bucket_left = self.plan.bucket_chunk_counts.tolist()
        self._received = np.zeros(self.count, dtype=bool)
        self._checksums = np.zeros(self.count, dtype=np.uint64)
        #: Chunks accepted so far.
        self.received = 0
        #: Number of leading buckets whose chunks have all arrived.
        self.complete_buckets = 0
        self._advance_bucket()

    @property
    def complete(self) -> bool:
        """Every chunk arrived (finish may still fail on the digest)."""
        return self.received == self.count

    def entry(self, seq: int) -> TensorEntry:
        return self.entries[self.tensor_of[seq]]

    def check(self, chunk: common_pb2.WeightChunk, data: bytes | memoryview, *, verify_payload: bool = True) -> int:
        """Accepts one chunk (header fields + its payload) or raises a CodecError; returns its sequence.

        With `verify_payload=False` the payload's checksum is left to the
        caller (`payload_error`), who must not let the version commit until
        it has compared it; everything else is checked here."""
        m, seq = self.manifest, chunk.sequence
        if chunk.version != m.version or chunk.base_version != m.base_version:
            raise ManifestMismatch(
                f"chunk {seq} is for version {chunk.version} (base {chunk.base_version}), "
                f"manifest is version {m.version} (base {m.base_version})"
            )
        if seq >= self.count:
            raise ManifestMismatch(f"chunk sequence {seq} is beyond the version's {self.count} chunks")
        entry = self.entry(seq)
        name = chunk.tensor_name
        if name != entry.name:
            if name not in self.index:
                raise ManifestMismatch(f"chunk {seq} is for unknown tensor {name!r} (not in the manifest)")
            raise ManifestMismatch(f"chunk {seq} is for tensor {name!r}; the manifest's layout puts {entry.name!r} there")
        if chunk.dtype != entry.dtype:
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} has dtype {dtype_name(chunk.dtype)}, manifest {dtype_name(entry.dtype)}"
            )
        if tuple(chunk.shape) != entry.shape:
            raise ManifestMismatch(f"tensor {name!r}: chunk {seq} has shape {list(chunk.shape)}, manifest {list(entry.shape)}")
        start, size = chunk.offset, len(data)
        if start + size > entry.nbytes:
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} covers bytes [{start}, {start + size}), "
                f"outside the tensor's {entry.nbytes} bytes"
            )
        want_start, want_size = self._offset_of[seq], self._length_of[seq]
        if start != want_start or size != want_size:
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} covers bytes [{start}, {start + size}) but the manifest's "
                f"layout has [{want_start}, {want_start + want_size}) there (overlapping or misplaced range)"
            )
        bucket = self._bucket_of[seq]
        if chunk.bucket_index != bucket:
            raise ManifestMismatch(f"tensor {name!r}: chunk {seq} claims bucket {chunk.bucket_index}, layout says {bucket}")
        if chunk.last != (seq == self.count - 1):
            raise ManifestMismatch(f"chunk {seq} has last={chunk.last}, but the version's final chunk is {self.count - 1}")
        if self._received[seq]:
            raise ChunkDuplicated(f"tensor {name!r}: chunk {seq} (bytes [{start}, {start + size})) arrived twice")
        if bucket > self.complete_buckets:
            raise ChunkOutOfOrder(
                f"tensor {name!r}: chunk {seq} of bucket {bucket} arrived while bucket {self.complete_buckets} "
                f"still misses {self._bucket_left[self.complete_buckets]} chunk(s)"
            )
        if verify_payload and (error := self.payload_error(seq, data, chunk.checksum)):
            raise error
        self._received[seq] = True
        self._checksums[seq] = chunk.checksum
        self.received += 1
        self._bucket_left[bucket] -= 1
        if bucket == self.complete_buckets:
            self._advance_bucket()
        return seq

    def payload_error(self, seq: int, data: bytes | memoryview | np.ndarray, checksum: int) -> ChunkCorrupted | None:
        """ChunkCorrupted if chunk `seq`'s payload does not hash to `checksum` (thread-safe: reads only)."""
        if xxhash.xxh3_64_intdigest(data) == checksum:
            return None
        start = self._offset_of[seq]
        return ChunkCorrupted(
            f"tensor {self.entry(seq).name!r}: chunk {seq} (bytes [{start}, {start + self._length_of[seq]})) "
            "does not match its checksum"
        )

    def _advance_bucket(self) -> None:
        left = self._bucket_left
        while self.complete_buckets < len(left) and left[self.complete_buckets] == 0:
            self.complete_buckets += 1

    def _missing_description(self) -> str:
        missing = np.flatnonzero(~self._received)
        parts = []
        for seq in missing[:3].tolist():
            start = self._offset_of[seq]
            parts.append(f"chunk {seq} (tensor {self.entry(seq).name!r} bytes [{start}, {start + self._length_of[seq]}))")
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"{len(missing)} of {self.count} chunks missing: {', '.join(parts)}{more}"

    def finish(self) -> None:
        """StreamTruncated / ChunkMissing / DigestMismatch unless the version is whole and intact."""
        v = self.manifest.version
        if self.received < self.count:
            if self.count and not self._received[self.count - 1]:
                raise StreamTruncated(f"version {v}: stream ended before its last chunk; {self._missing_description()}")
            raise ChunkMissing(f"version {v}: {self._missing_description()}")
        digest = compute_digest(self.manifest, self.entries, self.plan, self._checksums)
        if digest != self.manifest.digest:
            raise DigestMismatch(
                f"version {v}: every chunk arrived intact but the version digest is "
                f"{digest.hex()}, manifest says {self.manifest.digest.hex()} (manifest or checksums tampered)"
            )
        self._check_identity()

    def _check_identity(self) -> None:
        """With chunks of the identity's block size, the checksums are its block hashes:
        every tensor's identity digest is checked for free (other sizes: the receiver
        verifies the identity on what it loaded)."""
        m = self.manifest
        if m.chunk_bytes != IDENTITY_BLOCK_BYTES or m.base_version:
            return  # a delta's tensor digests are those of the tensors its records rebuild
        bounds = self.plan.tensor_bounds.tolist()
        for i, (entry, meta) in enumerate(zip(self.entries, m.tensors)):
            if not meta.digest:
                continue
            blocks = self._checksums[bounds[i] : bounds[i + 1]] if entry.nbytes else []
            if tensor_digest(entry.name, entry.dtype, entry.shape, entry.nbytes, blocks) != meta.digest:
                raise DigestMismatch(
                    f"version {m.version}: tensor {entry.name!r} arrived intact but its identity digest differs "
                    "from the manifest's (manifest tampered)")
