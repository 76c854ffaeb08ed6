"""A weight version's identity: a digest of its tensors that does not depend
on how they travelled.

The manifest's `digest` binds one transfer (its chunk size, bucket size and
order), so two correct transfers of the same weights can disagree on it. The
identity binds only the tensors: the same names, dtypes, shapes and bytes
give the same identity, whatever the transport, chunk size or stream order.
The publisher computes it once; the synchronizer records it with the
version; a replica recomputes it from the weights resident in its engine
after an update and reports it, which is what proves the engine holds the
version (not only that a transfer ended).

Definition (part of the wire contract, like the chunk layout):
  * block hashes: the tensor's row-major little-endian bytes cut into blocks
    of IDENTITY_BLOCK_BYTES (the last one shorter; none for 0 bytes), each
    hashed with XXH3-64 (seed 0);
  * tensor digest: XXH3-128 (seed 0, 16 bytes big-endian) over u32 name
    length, UTF-8 name, u32 DType, u32 ndim, ndim x i64 dims, u64 nbytes,
    then every block hash as a little-endian u64;
  * version digest: XXH3-128 over the tensor digests in the byte order of
    their UTF-8 names.

The block size equals the codec's default chunk size, so an encoder with
default chunks gets every block hash from the chunk checksums it computes
anyway: the identity costs no second pass over the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from flywheel.codec.dtypes import byte_view, contiguous_cpu, dtype_to_proto
from flywheel.codec.parallel import hash_many
from flywheel.common.v1 import common_pb2

#: Block size of the identity's hashes, in bytes (the codec's default chunk size).
IDENTITY_BLOCK_BYTES = 1 << 20
#: Bytes of a tensor or version digest (XXH3-128).
IDENTITY_BYTES = 16


def block_count(nbytes: int) -> int:
    return -(-nbytes // IDENTITY_BLOCK_BYTES)


def block_slices(view: memoryview) -> list[memoryview]:
    """The identity's blocks of a tensor's bytes."""
    return [view[start : start + IDENTITY_BLOCK_BYTES] for start in range(0, len(view), IDENTITY_BLOCK_BYTES)]


def tensor_digest(name: str, dtype: int, shape: Iterable[int], nbytes: int, blocks: Iterable[int]) -> bytes:
    """The digest of one tensor from its metadata and block hashes (see the module docstring)."""
    dims = tuple(int(d) for d in shape)
    encoded = name.encode("utf-8")
    h = xxhash.xxh3_128()
    h.update(struct.pack(f"<I{len(encoded)}sII{len(dims)}qQ", len(encoded), encoded, dtype, len(dims), *dims, nbytes))
    h.update(np.asarray(list(blocks) if not isinstance(blocks, np.ndarray) else blocks, dtype="<u8").tobytes())
    return h.digest()


def version_digest(tensor_digests: Mapping[str, bytes]) -> bytes:
    """The version's digest from its tensors' digests (order-free: sorted by UTF-8 name)."""
    h = xxhash.xxh3_128()
    for name in sorted(tensor_digests, key=lambda n: n.encode("utf-8")):
        h.update(tensor_digests[name])
    return h.digest()


@dataclass(frozen=True)
class VersionIdentity:
    """What a version is: its digest and each tensor's."""

    digest: bytes
    tensors: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def of(cls, tensors: Mapping[str, bytes]) -> VersionIdentity:
        return cls(version_digest(tensors), dict(tensors))

    def differences(self, other: VersionIdentity) -> list[str]:
        """Names whose tensors differ (missing on either side included), sorted."""
        names = set(self.tensors) | set(other.tensors)
        return sorted(n for n in names if self.tensors.get(n) != other.tensors.get(n))

    def describe_mismatch(self, expected: VersionIdentity, limit: int = 3) -> str:
        """A short account of how these (resident) tensors differ from `expected`'s."""
        differ = self.differences(expected)
        if not differ:
            return f"digest {self.hex[:16]} differs from {expected.hex[:16]}"
        shown = ", ".join(differ[:limit]) + (f" and {len(differ) - limit} more" if len(differ) > limit else "")
        return f"{len(differ)} tensor(s) differ: {shown}"


def manifest_identity(manifest: common_pb2.WeightManifest) -> VersionIdentity | None:
    """The identity a manifest carries (None from a manifest written before identities)."""
    if not manifest.identity:
        return None
    return VersionIdentity(bytes(manifest.identity), {t.name: bytes(t.digest) for t in manifest.tensors if t.digest})


def identify(state: Mapping[str, torch.Tensor]) -> VersionIdentity:
    """The identity of a state dict (one parallel XXH3-64 pass over its bytes).

    Tensors off the CPU or not contiguous are copied one at a time, so at
    most one extra tensor exists at once."""
    digests: dict[str, bytes] = {}
    plain_names: list[tuple[str, torch.Tensor]] = []
    plain_slices: list[memoryview] = []
    for name, tensor in state.items():
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            plain_names.append((name, tensor))
            plain_slices.extend(block_slices(byte_view(tensor)))
        else:
            host = contiguous_cpu(tensor)
            digests[name] = tensor_digest(
                name, dtype_to_proto(tensor.dtype), tensor.shape, host.numel() * host.element_size(),
                hash_many(block_slices(byte_view(host))),
            )
            del host
    hashes = hash_many(plain_slices) if plain_slices else []
    at = 0
    for name, tensor in plain_names:
        nbytes = tensor.numel() * tensor.element_size()
        n = block_count(nbytes)
        digests[name] = tensor_digest(name, dtype_to_proto(tensor.dtype), tensor.shape, nbytes, hashes[at : at + n])
        at += n
    return VersionIdentity.of(digests)
