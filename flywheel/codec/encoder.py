"""Sender side: a state dict -> one `WeightManifest` + a stream of `WeightChunk`.

No second copy of the model is ever made. Chunks are cut from memoryviews of
each tensor's own storage; only a non-contiguous (or non-CPU) tensor is
copied, one tensor at a time, and dropped once its chunks are out. The
manifest's digest needs every chunk checksum before the first chunk leaves, so
encoding does one XXH3-64 pass over the bytes up front and the chunks reuse
those checksums, any number of times (`chunks()` can be replayed to serve a
version to several receivers without hashing again).

The state must not change between `encode_state_dict` and the end of the last
`chunks()` iteration: a mutated tensor would no longer match its checksums,
and receivers would reject the version as corrupt (never accept it silently).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from flywheel.codec.dtypes import byte_view, contiguous_cpu, dtype_to_proto
from flywheel.codec.errors import InvalidManifest
from flywheel.codec.identity import IDENTITY_BLOCK_BYTES, block_slices, tensor_digest, version_digest
from flywheel.codec.layout import ChunkPlan, TensorEntry, compute_digest, plan_chunks
from flywheel.codec.malloc import tune_allocator
from flywheel.codec.parallel import hash_many
from flywheel.codec.wire import serialize_chunk
from flywheel.common.v1 import common_pb2

MiB = 1 << 20

#: gRPC's default max message size (both directions), in bytes.
GRPC_DEFAULT_MAX_MESSAGE_BYTES = 4 * MiB
#: Room for a chunk's non-payload fields (name up to MAX_NAME_BYTES, shape,
#: offsets, framing), so a full chunk stays under the gRPC default limit.
CHUNK_OVERHEAD_BYTES = 64 * 1024
#: Largest payload per chunk that still fits gRPC's default 4 MiB message.
MAX_CHUNK_BYTES = GRPC_DEFAULT_MAX_MESSAGE_BYTES - CHUNK_OVERHEAD_BYTES
#: Longest tensor name, UTF-8 bytes.
MAX_NAME_BYTES = 16 * 1024
#: Payload per chunk. 1 MiB: 2 and 4 MiB measured no faster (bench/codec.py
#: --chunk-mib; per-chunk overhead is ~40 us of Python), it is 4x under the
#: gRPC limit, and a chunk's transient copies stay within a core's L2 cache.
DEFAULT_CHUNK_BYTES = 1 * MiB
#: Target bucket size. 256 MiB bounds the extra buffer a packed NCCL/gloo
#: broadcast needs per bucket on each rank, while keeping per-collective
#: latency (tens of microseconds) under 1% of a bucket's transfer time even at
#: 50 GB/s; and for streams it bounds how far chunks may be reordered.
DEFAULT_BUCKET_BYTES = 256 * MiB


class EncodedVersion:
    """A state dict ready to stream: `manifest`, then `chunks()` (message
    objects) or `serialized_chunks()` (the same chunks as wire bytes)."""

    def __init__(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        entries: list[TensorEntry],
        plan: ChunkPlan,
        checksums: np.ndarray,
        manifest: common_pb2.WeightManifest,
    ) -> None:
        self._tensors = tensors
        self._entries = entries
        self._plan = plan
        self._checksums = checksums
        #: The version's manifest; send it before the chunks.
        self.manifest = manifest

    @property
    def chunk_count(self) -> int:
        return self._plan.count

    @property
    def checksums(self) -> np.ndarray:
        """XXH3-64 of every chunk, in sequence order (read-only view)."""
        view = self._checksums.view()
        view.flags.writeable = False
        return view

    def chunks(self) -> Iterator[common_pb2.WeightChunk]:
        """Yield the version's chunks in sequence order; re-iterable.

        Each chunk's payload is copied out of the tensor's memory into the
        message; at most one tensor is held as an extra contiguous copy.
        """
        for header, payload in self.pieces():
            header.data = payload.tobytes()
            yield header

    def serialized_chunks(self) -> Iterator[bytes]:
        """The same chunks as wire bytes (one payload copy each; see `wire`)."""
        for header, payload in self.pieces():
            yield serialize_chunk(header, payload)

    def pieces(self) -> Iterator[tuple[common_pb2.WeightChunk, memoryview]]:
        """(chunk with empty data, zero-copy view of its payload) in sequence
        order, for transports that frame the payload themselves. A view is
        valid until the iteration moves past its tensor."""
        m = self.manifest
        last = self._plan.count - 1
        bounds = self._plan.tensor_bounds.tolist()
        offsets = self._plan.offset.tolist()
        lengths = self._plan.length.tolist()
        buckets = self._plan.bucket_index.tolist()
        checksums = self._checksums.tolist()
        for i, ((name, tensor), entry) in enumerate(zip(self._tensors, self._entries)):
            view = byte_view(contiguous_cpu(tensor))
            shape = list(entry.shape)
            for seq in range(bounds[i], bounds[i + 1]):
                start = offsets[seq]
                header = common_pb2.WeightChunk(
                    version=m.version,
                    base_version=m.base_version,
                    tensor_name=name,
                    dtype=entry.dtype,
                    shape=shape,
                    offset=start,
                    checksum=checksums[seq],
                    last=seq == last,
                    bucket_index=buckets[seq],
                    sequence=seq,
                )
                yield header, view[start : start + lengths[seq]]
            del view  # release a temporary contiguous copy before the next tensor

    def __iter__(self) -> Iterator[common_pb2.WeightManifest | common_pb2.WeightChunk]:
        """The whole version as it goes on the wire: manifest, then chunks."""
        yield self.manifest
        yield from self.chunks()


def _check_sizes(chunk_bytes: int, bucket_bytes: int) -> None:
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}] (gRPC's 4 MiB limit), got {chunk_bytes}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")


def _entries(state: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], list[TensorEntry]]:
    tensors: list[tuple[str, torch.Tensor]] = []
    entries: list[TensorEntry] = []
    for name, tensor in state.items():
        if not isinstance(name, str) or not name:
            raise InvalidManifest(f"tensor names must be non-empty strings, got {name!r}")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidManifest(f"tensor name {name[:64]!r}... is longer than {MAX_NAME_BYTES} bytes")
        if not isinstance(tensor, torch.Tensor):
            raise InvalidManifest(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        entries.append(
            TensorEntry(name, dtype_to_proto(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())
        )
        tensors.append((name, tensor))
    return tensors, entries


def _is_plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _checksums(tensors: list[tuple[str, torch.Tensor]], plan: ChunkPlan) -> np.ndarray:
    """XXH3-64 of every chunk. Tensors already contiguous on CPU are hashed
    in one parallel sweep straight from their memory; others are made
    contiguous and hashed one at a time, so at most one copy exists."""
    out = np.empty(plan.count, dtype=np.uint64)
    bounds = plan.tensor_bounds.tolist()
    offsets = plan.offset.tolist()
    lengths = plan.length.tolist()
    sweep_seqs: list[int] = []
    sweep: list[memoryview] = []
    for i, (_, tensor) in enumerate(tensors):
        lo, hi = bounds[i], bounds[i + 1]
        view = byte_view(contiguous_cpu(tensor))
        slices = [view[offsets[s] : offsets[s] + lengths[s]] for s in range(lo, hi)]
        if _is_plain(tensor):
            sweep_seqs.extend(range(lo, hi))
            sweep.extend(slices)
        else:
            out[lo:hi] = hash_many(slices)
        del view, slices  # release a temporary contiguous copy before the next tensor
    if sweep:
        out[sweep_seqs] = hash_many(sweep)
    return out


def _tensor_digests(
    tensors: list[tuple[str, torch.Tensor]], entries: list[TensorEntry], plan: ChunkPlan, checksums: np.ndarray,
    chunk_bytes: int,
) -> list[bytes]:
    """Each tensor's identity digest (flywheel.codec.identity). With chunks of
    the identity's block size the chunk checksums are its block hashes; other
    chunk sizes cost one more hashing pass."""
    digests: list[bytes] = []
    bounds = plan.tensor_bounds.tolist()
    for i, ((_, tensor), e) in enumerate(zip(tensors, entries)):
        if e.nbytes == 0:
            blocks: list[int] | np.ndarray = []
        elif chunk_bytes == IDENTITY_BLOCK_BYTES:
            blocks = checksums[bounds[i] : bounds[i + 1]]
        else:
            blocks = hash_many(block_slices(byte_view(contiguous_cpu(tensor))))
        digests.append(tensor_digest(e.name, e.dtype, e.shape, e.nbytes, blocks))
    return digests


def encode_state_dict(
    state: Mapping[str, torch.Tensor],
    version: int,
    base_version: int = 0,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> EncodedVersion:
    """Checksum `state` (in its iteration order) and return it ready to stream,
    its manifest carrying the version's identity (flywheel.codec.identity).

    Raises UnsupportedDType / InvalidManifest for tensors that cannot travel,
    ValueError for out-of-range sizes or versions.
    """
    if version < 1 or not 0 <= base_version < version:
        raise ValueError(f"need version >= 1 and 0 <= base_version < version, got {version}, {base_version}")
    _check_sizes(chunk_bytes, bucket_bytes)
    tune_allocator()
    tensors, entries = _entries(state)
    plan = plan_chunks([e.nbytes for e in entries], chunk_bytes, bucket_bytes)
    checksums = _checksums(tensors, plan)
    digests = _tensor_digests(tensors, entries, plan, checksums, chunk_bytes)
    manifest = common_pb2.WeightManifest(
        version=version,
        base_version=base_version,
        tensors=[
            common_pb2.TensorMeta(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes, digest=d)
            for e, d in zip(entries, digests)
        ],
        total_bytes=sum(e.nbytes for e in entries),
        chunk_count=plan.count,
        chunk_bytes=chunk_bytes,
        bucket_bytes=bucket_bytes,
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_XXH3,
    )
    manifest.digest = compute_digest(manifest, entries, plan, checksums)
    manifest.identity = version_digest({e.name: d for e, d in zip(entries, digests)})
    return EncodedVersion(tensors, entries, plan, checksums, manifest)


def build_manifest(
    state: Mapping[str, torch.Tensor], version: int, *args: Any, **kwargs: Any
) -> common_pb2.WeightManifest:
    """Just the manifest (with digest) of `state`; costs one checksum pass. The other arguments
    and their defaults are `encode_state_dict`'s."""
    return encode_state_dict(state, version, *args, **kwargs).manifest
