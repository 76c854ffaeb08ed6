"""Receiver side: manifest + chunks -> tensors, all or nothing.

`WeightAssembler` takes a manifest, then chunks one at a time as they arrive,
checks each against the manifest's layout and its checksum
(`flywheel.codec.checker`: the rules every receiver shares), and writes its
bytes into STAGING tensors. `commit()` checks that every chunk arrived and
that the whole-version digest matches, and only then copies staging into the destination tensors (or, with no destination,
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

from flywheel.codec.background import BackgroundStager
from flywheel.codec.checker import ChunkChecker
from flywheel.codec.dtypes import byte_view, dtype_from_proto
from flywheel.codec.errors import AssemblerClosed, CodecError, ManifestMismatch
from flywheel.codec.layout import TensorEntry
from flywheel.codec.malloc import tune_allocator
from flywheel.codec.parallel import codec_pool, copy_pairs
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
    stage_in_background: copy and checksum each chunk on the codec's thread
        pool while the caller goes on (see `flywheel.codec.background`): about
        twice as fast on two cores, but a corrupt chunk is reported a few
        chunks later (at the latest by commit, before anything is written),
        and each payload must stay unchanged until commit returns. `add` and
        `add_piece` qualify; `add_serialized` stages its (often reused)
        buffer synchronously either way.
    """

    def __init__(
        self,
        manifest: common_pb2.WeightManifest,
        destination: Mapping[str, torch.Tensor] | None = None,
        *,
        staging: Mapping[str, torch.Tensor] | None = None,
        stage_in_background: bool = False,
    ) -> None:
        self._checker = ChunkChecker(manifest)  # validates the manifest first
        pool = codec_pool() if stage_in_background else None
        self._background = BackgroundStager(self._checker, pool) if pool is not None else None
        entries = self._checker.entries
        tune_allocator()
        if destination is not None:
            check_tensors_match(destination, entries, "destination")
        if staging is None:
            pin = destination is not None and torch.cuda.is_available() and any(t.is_cuda for t in destination.values())
            staging = _allocate_staging(entries, pin)
        else:
            _check_staging(staging, entries, destination)
        self.manifest = manifest
        self._destination = dict(destination) if destination is not None else None
        self._staging = {e.name: staging[e.name] for e in entries}
        # Byte views of staging: chunk payloads are copied in by offset with
        # numpy, which drops the GIL for the memcpy (a gRPC thread can keep
        # receiving) and, unlike torch's copy_, does not fan a 1 MiB copy out
        # to an OpenMP pool, which stalls badly when the cores are busy.
        self._stage_bytes = [_u8(staging[e.name]) for e in entries]
        self._closed: str | None = None

    # -- state ---------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def received(self) -> int:
        """Chunks accepted so far."""
        return self._checker.received

    @property
    def complete(self) -> bool:
        """Every chunk arrived (commit may still fail on the digest)."""
        return self._checker.complete

    @property
    def complete_buckets(self) -> int:
        """Number of leading buckets whose chunks have all arrived."""
        return self._checker.complete_buckets

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
        costs (see `flywheel.codec.wire`). Always synchronous: `buf` may be
        reused by the caller as soon as this returns."""
        self._guarded(lambda b: self._add(*parse_chunk(b), reusable=True), buf)

    def add_piece(self, header: common_pb2.WeightChunk, payload: bytes | memoryview) -> None:
        """`add` for a chunk as header fields (empty data) plus its payload, as
        `EncodedVersion.pieces()` yields them: no copy before staging."""
        self._guarded(lambda p: self._add(*p), (header, payload))

    def _guarded(self, step: Callable[[Any], None], arg: Any) -> None:
        """Run one step; the first CodecError spends the assembler."""
        if self._closed is not None:
            raise AssemblerClosed(f"assembler for version {self.version} is {self._closed}; start a new one")
        try:
            step(arg)
        except CodecError as exc:
            if self._background is not None:
                self._background.wait()  # nothing may write staging once the assembler is spent
            self._closed = f"failed ({type(exc).__name__}: {exc})"
            raise

    def _add(
        self, chunk: common_pb2.WeightChunk, data: bytes | memoryview | None = None, *, reusable: bool = False
    ) -> None:
        if data is None:
            data = chunk.data  # one copy out of the message; read it only once
        background = self._background if len(data) and not reusable else None
        seq = self._checker.check(chunk, data, verify_payload=background is None)
        if not len(data):
            return
        start = chunk.offset
        staging = self._stage_bytes[self._checker.tensor_of[seq]][start : start + len(data)]
        payload = np.frombuffer(data, dtype=np.uint8)
        if background is None:
            np.copyto(staging, payload)
        else:
            background.add(seq, staging, payload, chunk.checksum)
            background.raise_failed()

    # -- committing ----------------------------------------------------------

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
                pairs.append((_u8(dst), self._stage_bytes[self._checker.index[name]]))
            else:
                dst.copy_(self._staging[name])
        copy_pairs(pairs)
        return self._destination

    def abandon(self) -> None:
        """Gives the version up (the receiver failed or was cancelled): waits for
        background copies, so that once this returns nothing reads the
        payloads handed in or writes staging any more. Idempotent."""
        if self._background is not None:
            self._background.wait()
        if self._closed is None:
            self._closed = "abandoned"

    def _verify(self) -> None:
        if self._background is not None:
            self._background.finish()
        self._checker.finish()


def assemble(
    manifest: common_pb2.WeightManifest,
    chunks: Iterable[common_pb2.WeightChunk],
    destination: Mapping[str, torch.Tensor] | None = None,
    *,
    staging: Mapping[str, torch.Tensor] | None = None,
    stage_in_background: bool = False,
) -> dict[str, torch.Tensor]:
    """Receive a whole version from an iterable of chunks and commit it.

    The end of `chunks` is the end of the stream: if it ends early,
    StreamTruncated; the destination is untouched on every error.
    """
    assembler = WeightAssembler(manifest, destination, staging=staging, stage_in_background=stage_in_background)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.commit()
