"""Receiver side: manifest + chunks -> tensors, all or nothing.

`WeightAssembler` takes a manifest, then chunks one at a time as they arrive,
checks each against the manifest's layout (see `flywheel.codec.layout`) and
its checksum, and writes its bytes into STAGING tensors. `commit()` checks
that every chunk arrived and that the whole-version digest matches, and only
then copies staging into the destination tensors (or, with no destination,
hands the staging tensors over, so that path costs no extra copy). Until a
successful commit the destination is never written, so on any error it stays
bit-identical to what it was.

Reordering tolerance: chunks of the current bucket (the lowest one with
chunks still missing) may arrive in any order; a chunk of a later bucket
before the current one is complete is `ChunkOutOfOrder`. A receiver can thus
verify and stage bucket by bucket, and a sender may parallelise within one.

After any error the assembler is spent: further calls raise AssemblerClosed.
An assembler is not thread-safe: feed it from one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from flywheel.codec.dtypes import byte_view, dtype_from_proto, dtype_name
from flywheel.codec.errors import (
    AssemblerClosed,
    ChunkCorrupted,
    ChunkDuplicated,
    ChunkMissing,
    ChunkOutOfOrder,
    CodecError,
    DigestMismatch,
    InvalidManifest,
    ManifestMismatch,
    StreamTruncated,
)
from flywheel.codec.layout import TensorEntry, compute_digest, validate_manifest
from flywheel.codec.malloc import tune_allocator
from flywheel.codec.parallel import copy_pairs
from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2


def check_tensors_match(tensors: Mapping[str, torch.Tensor], entries: list[TensorEntry], what: str) -> None:
    """ManifestMismatch unless `tensors` has exactly the manifest's names, dtypes and shapes."""
    names = {e.name for e in entries}
    missing = [e.name for e in entries if e.name not in tensors]
    extra = [n for n in tensors if n not in names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"not in the manifest {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''}")
        raise ManifestMismatch(f"{what} tensors do not match the manifest: {'; '.join(parts)}")
    for e in entries:
        t = tensors[e.name]
        if not isinstance(t, torch.Tensor):
            raise ManifestMismatch(f"{what} {e.name!r} is a {type(t).__name__}, not a torch.Tensor")
        want_dtype = dtype_from_proto(e.dtype)
        if t.dtype != want_dtype:
            raise ManifestMismatch(
                f"tensor {e.name!r}: manifest dtype {str(want_dtype).removeprefix('torch.')}, "
                f"{what} dtype {str(t.dtype).removeprefix('torch.')}"
            )
        if tuple(t.shape) != e.shape:
            raise ManifestMismatch(f"tensor {e.name!r}: manifest shape {list(e.shape)}, {what} shape {list(t.shape)}")


def _allocate_staging(entries: list[TensorEntry], pin: bool) -> dict[str, torch.Tensor]:
    return {e.name: torch.empty(e.shape, dtype=dtype_from_proto(e.dtype), pin_memory=pin) for e in entries}


def _check_staging(
    staging: Mapping[str, torch.Tensor], entries: list[TensorEntry], destination: Mapping[str, torch.Tensor] | None
) -> None:
    check_tensors_match(staging, entries, "staging")
    for e in entries:
        t = staging[e.name]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"staging tensor {e.name!r} must be a contiguous CPU tensor")
        if (
            destination is not None
            and e.nbytes
            and (t.untyped_storage().data_ptr() == destination[e.name].untyped_storage().data_ptr())
        ):
            raise ValueError(
                f"staging tensor {e.name!r} shares memory with its destination; commit would not be atomic"
            )


def _u8(t: torch.Tensor) -> np.ndarray:
    """Writable uint8 numpy view of a contiguous CPU tensor's bytes."""
    return np.frombuffer(byte_view(t), dtype=np.uint8)


class WeightAssembler:
    """Assembles one weight version from its manifest and chunks, atomically.

    destination: existing tensors to update on commit (any device; names,
        dtypes and shapes must equal the manifest's), or None to get fresh
        CPU tensors back from commit().
    staging: optional contiguous CPU tensors (same names/dtypes/shapes) to
        stage into, so a long-running receiver reuses one buffer instead of
        allocating (and page-faulting) a model's worth of memory per version:
        with a destination, pass the previous assembler's `staging`; without
        one, commit() hands the staging tensors over to the caller, who may
        pass them back once nothing reads them any more (e.g. a synchronizer
        recycling its oldest buffered version).
    """

    def __init__(
        self,
        manifest: common_pb2.WeightManifest,
        destination: Mapping[str, torch.Tensor] | None = None,
        *,
        staging: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if manifest.version < 1:
            raise InvalidManifest(f"manifest version must be >= 1, got {manifest.version}")
        entries, plan = validate_manifest(manifest)
        tune_allocator()
        if destination is not None:
            check_tensors_match(destination, entries, "destination")
        if staging is None:
            pin = destination is not None and torch.cuda.is_available() and any(t.is_cuda for t in destination.values())
            staging = _allocate_staging(entries, pin)
        else:
            _check_staging(staging, entries, destination)
        self.manifest = manifest
        self._entries = entries
        self._index = {e.name: i for i, e in enumerate(entries)}
        self._plan = plan
        self._destination = dict(destination) if destination is not None else None
        self._staging = {e.name: staging[e.name] for e in entries}
        # Byte views of staging: chunk payloads are copied in by offset with
        # numpy, which drops the GIL for the memcpy (a gRPC thread can keep
        # receiving) and, unlike torch's copy_, does not fan a 1 MiB copy out
        # to an OpenMP pool, which stalls badly when the cores are busy.
        self._stage_bytes = [_u8(staging[e.name]) for e in entries]
        self._count = plan.count
        self._tensor_of = plan.tensor_index.tolist()
        self._bucket_of = plan.bucket_index.tolist()
        self._offset_of = plan.offset.tolist()
        self._length_of = plan.length.tolist()
        self._bucket_left = plan.bucket_chunk_counts.tolist()
        self._received = np.zeros(self._count, dtype=bool)
        self._checksums = np.zeros(self._count, dtype=np.uint64)
        self._n_received = 0
        self._open_bucket = 0
        self._advance_bucket()
        self._closed: str | None = None

    # -- state ---------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def received(self) -> int:
        """Chunks accepted so far."""
        return self._n_received

    @property
    def complete(self) -> bool:
        """Every chunk arrived (commit may still fail on the digest)."""
        return self._n_received == self._count

    @property
    def complete_buckets(self) -> int:
        """Number of leading buckets whose chunks have all arrived."""
        return self._open_bucket

    @property
    def staging(self) -> dict[str, torch.Tensor]:
        """The staging tensors (reusable for the next version's assembler)."""
        return self._staging

    # -- receiving -----------------------------------------------------------

    def add(self, chunk: common_pb2.WeightChunk) -> None:
        """Validate one chunk and stage its bytes; raises a CodecError subclass."""
        self._guarded(self._add, chunk)

    def add_serialized(self, buf: bytes | bytearray | memoryview) -> None:
        """`add` for a chunk still in wire bytes: the payload is hashed and
        staged straight from `buf`, saving the two copies a message object
        costs (see `flywheel.codec.wire`)."""
        self._guarded(lambda b: self._add(*parse_chunk(b)), buf)

    def _guarded(self, step: Callable[[Any], None], arg: Any) -> None:
        """Run one step; the first CodecError spends the assembler."""
        if self._closed is not None:
            raise AssemblerClosed(f"assembler for version {self.version} is {self._closed}; start a new one")
        try:
            step(arg)
        except CodecError as exc:
            self._closed = f"failed ({type(exc).__name__}: {exc})"
            raise

    def _add(self, chunk: common_pb2.WeightChunk, data: bytes | memoryview | None = None) -> None:
        m = self.manifest
        seq = chunk.sequence
        if chunk.version != m.version or chunk.base_version != m.base_version:
            raise ManifestMismatch(
                f"chunk {seq} is for version {chunk.version} (base {chunk.base_version}), "
                f"manifest is version {m.version} (base {m.base_version})"
            )
        if seq >= self._count:
            raise ManifestMismatch(f"chunk sequence {seq} is beyond the version's {self._count} chunks")
        ti = self._tensor_of[seq]
        entry = self._entries[ti]
        name = chunk.tensor_name
        if name != entry.name:
            if name not in self._index:
                raise ManifestMismatch(f"chunk {seq} is for unknown tensor {name!r} (not in the manifest)")
            raise ManifestMismatch(
                f"chunk {seq} is for tensor {name!r}; the manifest's layout puts {entry.name!r} there"
            )
        if chunk.dtype != entry.dtype:
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} has dtype {dtype_name(chunk.dtype)}, manifest {dtype_name(entry.dtype)}"
            )
        if tuple(chunk.shape) != entry.shape:
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} has shape {list(chunk.shape)}, manifest {list(entry.shape)}"
            )
        if data is None:
            data = chunk.data  # one copy out of the message; read it only once
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
            raise ManifestMismatch(
                f"tensor {name!r}: chunk {seq} claims bucket {chunk.bucket_index}, layout says {bucket}"
            )
        if chunk.last != (seq == self._count - 1):
            raise ManifestMismatch(
                f"chunk {seq} has last={chunk.last}, but the version's final chunk is {self._count - 1}"
            )
        if self._received[seq]:
            raise ChunkDuplicated(f"tensor {name!r}: chunk {seq} (bytes [{start}, {start + size})) arrived twice")
        if bucket > self._open_bucket:
            raise ChunkOutOfOrder(
                f"tensor {name!r}: chunk {seq} of bucket {bucket} arrived while bucket {self._open_bucket} "
                f"still misses {self._bucket_left[self._open_bucket]} chunk(s)"
            )
        if xxhash.xxh3_64_intdigest(data) != chunk.checksum:
            raise ChunkCorrupted(
                f"tensor {name!r}: chunk {seq} (bytes [{start}, {start + size})) does not match its checksum"
            )
        if size:
            np.copyto(self._stage_bytes[ti][start : start + size], np.frombuffer(data, dtype=np.uint8))
        self._received[seq] = True
        self._checksums[seq] = chunk.checksum
        self._n_received += 1
        self._bucket_left[bucket] -= 1
        if bucket == self._open_bucket:
            self._advance_bucket()

    def _advance_bucket(self) -> None:
        left = self._bucket_left
        while self._open_bucket < len(left) and left[self._open_bucket] == 0:
            self._open_bucket += 1

    # -- committing ----------------------------------------------------------

    def _missing_description(self) -> str:
        missing = np.flatnonzero(~self._received)
        parts = []
        for seq in missing[:3].tolist():
            e = self._entries[self._tensor_of[seq]]
            start = self._offset_of[seq]
            parts.append(f"chunk {seq} (tensor {e.name!r} bytes [{start}, {start + self._length_of[seq]}))")
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"{len(missing)} of {self._count} chunks missing: {', '.join(parts)}{more}"

    def commit(self) -> dict[str, torch.Tensor]:
        """Verify completeness and digest, then update the destination.

        Returns the destination tensors (or the staging tensors, handed over,
        when no destination was given). Raises StreamTruncated / ChunkMissing
        / DigestMismatch without touching the destination.
        """
        self._guarded(lambda _: self._verify(), None)
        self._closed = "committed"
        if self._destination is None:
            return self._staging
        # CPU destinations: one parallel memcpy over all tensors; others
        # (CUDA, non-contiguous) through torch.
        pairs = []
        for name, dst in self._destination.items():
            if dst.device.type == "cpu" and dst.is_contiguous():
                pairs.append((_u8(dst), self._stage_bytes[self._index[name]]))
            else:
                dst.copy_(self._staging[name])
        copy_pairs(pairs)
        return self._destination

    def _verify(self) -> None:
        if self._n_received < self._count:
            if self._count and not self._received[self._count - 1]:
                raise StreamTruncated(
                    f"version {self.version}: stream ended before its last chunk; {self._missing_description()}"
                )
            raise ChunkMissing(f"version {self.version}: {self._missing_description()}")
        digest = compute_digest(self.manifest, self._entries, self._plan, self._checksums)
        if digest != self.manifest.digest:
            raise DigestMismatch(
                f"version {self.version}: every chunk arrived intact but the version digest is "
                f"{digest.hex()}, manifest says {self.manifest.digest.hex()} (manifest or checksums tampered)"
            )


def assemble(
    manifest: common_pb2.WeightManifest,
    chunks: Iterable[common_pb2.WeightChunk],
    destination: Mapping[str, torch.Tensor] | None = None,
    *,
    staging: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive a whole version from an iterable of chunks and commit it.

    The end of `chunks` is the end of the stream: if it ends early,
    StreamTruncated; the destination is untouched on every error.
    """
    assembler = WeightAssembler(manifest, destination, staging=staging)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.commit()
