"""Delta versions: version N as what changed since a version M the receiver holds.

One step of RL fine-tuning changes few of a model's values where they are
stored in bfloat16 (a few percent a step at the quickstart's learning rate),
and in float32 it changes nearly all of them but only in their low bits. So
a far replica that holds M is sent, per tensor, the smallest of:

  SAME    the tensor did not change: the kind byte alone;
  SPARSE  the changed elements: their positions (gaps between consecutive
          indices) and their new values, byte-shuffled and zstd-compressed;
  XOR     base XOR new over the raw bytes, byte-shuffled (the bytes of one
          significance together: in float32 the sign and exponent bytes of
          the XOR are nearly all zero) and zstd-compressed;
  RAW     the new tensor's bytes as they are (a tensor replaced outright).

Record of one tensor (the bytes a delta carries for it):
  u8 kind, then
  SAME:   nothing;
  RAW:    the tensor's nbytes, row-major little-endian;
  XOR:    one zstd frame of shuffle(base ^ new) (nbytes when decompressed);
  SPARSE: u64 LE count of changed elements, then one zstd frame of
          shuffle(gaps) + shuffle(values): gaps as u32 (u64 when the tensor
          has 2**32 elements or more), the first gap being the first index;
          values in the tensor's dtype.
`shuffle` stores the k-th byte of every element together, k = 0..itemsize-1.

On the wire (`encode_delta_version`) a delta is an ordinary version stream
whose manifest names the base (`base_version` M) and whose tensors are the
records, one UINT8 tensor per tensor of N under N's name: chunk checksums and
the manifest digest protect the records in transit exactly as they protect a
full version. The manifest's `identity` is version N's (what the records
rebuild, checked by `apply_delta`), and its TensorMeta digests are those of
N's tensors (so a mismatch names the tensors), not of the records' bytes.

A delta is only as good as the base it is applied to, so applying one
(`apply_delta`) rebuilds every tensor, recomputes the result's identity
(`flywheel.codec.identity`) and compares it with version N's before returning
anything: a corrupt record, a wrong base or a wrong delta is refused whole,
and the caller's weights are untouched (they are only read).

Decompression is bounded by the size the record must have, so a hostile or
corrupt frame cannot make the receiver allocate more than the tensor.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

from flywheel.codec.dtypes import byte_view, contiguous_cpu, u8_from_buffer
from flywheel.codec.encoder import DEFAULT_CHUNK_BYTES, EncodedVersion, encode_state_dict
from flywheel.codec.errors import DigestMismatch, ManifestMismatch
from flywheel.codec.identity import VersionIdentity, identify

#: zstd level of delta records: level 3 (zstd's default) compresses a float32 XOR about as well as
#: level 9 here at several times the speed, and a delta is made once per version, read by many.
ZSTD_LEVEL = 3
#: SPARSE is tried when at most this fraction of elements changed: above it, positions cost more
#: than XOR's runs of zero bytes.
SPARSE_TRY_FRACTION = 0.25


class DeltaKind(enum.IntEnum):
    SAME = 0
    SPARSE = 1
    XOR = 2
    RAW = 3


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaCorrupted(DigestMismatch):
    """A record that cannot be decoded into the tensor it is for (truncated, bad frame, bad sizes)."""


@dataclass
class VersionDelta:
    """Records of every tensor of version N, from base M."""

    records: dict[str, bytes]
    #: Bytes of version N in full (what a full transfer carries).
    full_nbytes: int
    kinds: dict[str, DeltaKind] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(r) for r in self.records.values())

    @property
    def fraction(self) -> float:
        """Delta bytes over full bytes (1.0 for an empty model)."""
        return self.nbytes / self.full_nbytes if self.full_nbytes else 1.0


def _elements(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of its item size (bit patterns, no copy)."""
    return np.frombuffer(byte_view(t), dtype=_UINT[t.element_size()])


def _shuffle(values: np.ndarray) -> bytes:
    size = values.dtype.itemsize
    if size == 1:
        return values.tobytes()
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, size).T).tobytes()


def _unshuffle(data: bytes | memoryview, dtype: type[np.generic], count: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    planes = np.frombuffer(data, dtype=np.uint8, count=count * size)
    if size == 1:
        return planes.view(dtype)
    return np.ascontiguousarray(planes.reshape(size, count).T).view(dtype).reshape(count)


def _gap_dtype(numel: int) -> type[np.generic]:
    return np.uint32 if numel < 2**32 else np.uint64


def encode_tensor_delta(base: torch.Tensor, new: torch.Tensor, compressor: zstandard.ZstdCompressor | None = None) -> bytes:
    """The record that turns `base` into `new` (same dtype and shape), the smallest of the four kinds."""
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ManifestMismatch(f"a delta needs the same dtype and shape: {base.dtype}{tuple(base.shape)} "
                               f"-> {new.dtype}{tuple(new.shape)}")
    compressor = compressor or zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    base, new = contiguous_cpu(base), contiguous_cpu(new)
    old_bits, new_bits = _elements(base), _elements(new)
    xor = np.bitwise_xor(old_bits, new_bits)
    changed_count = int(np.count_nonzero(xor))
    if changed_count == 0:
        return bytes([DeltaKind.SAME])
    candidates = [bytes([DeltaKind.XOR]) + compressor.compress(_shuffle(xor))]
    if changed_count <= SPARSE_TRY_FRACTION * new_bits.size:
        changed = np.flatnonzero(xor)  # 8 bytes a position: only when few changed
        gaps = np.diff(changed, prepend=0).astype(_gap_dtype(new_bits.size))
        payload = _shuffle(gaps) + _shuffle(new_bits[changed])
        candidates.append(bytes([DeltaKind.SPARSE]) + struct.pack("<Q", changed.size) + compressor.compress(payload))
    best = min(candidates, key=len)
    if len(best) < 1 + new_bits.nbytes:
        return best
    return bytes([DeltaKind.RAW]) + new_bits.tobytes()  # nothing smaller than the tensor itself


def _decompress(frame: memoryview, size: int, name: str) -> bytes:
    try:
        stated = zstandard.frame_content_size(frame)  # refused before anything is allocated
        if stated > size:
            raise DeltaCorrupted(f"delta record of {name!r}: its frame holds {stated} bytes, expected {size}")
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise DeltaCorrupted(f"delta record of {name!r}: {exc}") from exc
    if len(data) != size:
        raise DeltaCorrupted(f"delta record of {name!r}: {len(data)} bytes decompressed, expected {size}")
    return data


def apply_tensor_delta(base: torch.Tensor, record: bytes | memoryview, name: str = "tensor") -> torch.Tensor:
    """A new tensor: `base` (only read) with `record` applied. Raises DeltaCorrupted on a malformed record."""
    view = memoryview(record)
    if len(view) == 0:
        raise DeltaCorrupted(f"delta record of {name!r} is empty")
    try:
        kind = DeltaKind(view[0])
    except ValueError:
        raise DeltaCorrupted(f"delta record of {name!r} has unknown kind {view[0]}") from None
    body = view[1:]
    base = contiguous_cpu(base)
    out = base.clone()
    if kind is DeltaKind.SAME:
        if len(body):
            raise DeltaCorrupted(f"delta record of {name!r}: SAME carries {len(body)} stray bytes")
        return out
    bits = _elements(out)
    dtype = bits.dtype.type
    if kind is DeltaKind.RAW:
        if len(body) != bits.nbytes:
            raise DeltaCorrupted(f"delta record of {name!r}: RAW has {len(body)} bytes, expected {bits.nbytes}")
        bits[:] = np.frombuffer(body, dtype=dtype)
    elif kind is DeltaKind.XOR:
        xor = _unshuffle(_decompress(body, bits.nbytes, name), dtype, bits.size)
        np.bitwise_xor(bits, xor, out=bits)
    else:
        if len(body) < 8:
            raise DeltaCorrupted(f"delta record of {name!r}: SPARSE is truncated")
        (count,) = struct.unpack_from("<Q", body)
        gap_dtype = _gap_dtype(bits.size)
        if not 0 < count <= bits.size:
            raise DeltaCorrupted(f"delta record of {name!r}: {count} changed of {bits.size} elements")
        gap_size = np.dtype(gap_dtype).itemsize
        data = _decompress(body[8:], count * (gap_size + bits.itemsize), name)
        gaps = _unshuffle(memoryview(data)[: count * gap_size], gap_dtype, count)
        values = _unshuffle(memoryview(data)[count * gap_size :], dtype, count)
        index = np.cumsum(gaps, dtype=np.uint64)
        if index[-1] >= bits.size or (count > 1 and not np.all(gaps[1:])):
            raise DeltaCorrupted(f"delta record of {name!r}: positions out of range or repeated")
        bits[index.astype(np.int64)] = values
    return out


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> VersionDelta:
    """Version `new` as records against `base`: the same tensor names, dtypes and shapes on both
    sides (a changed architecture is a full transfer, which the caller chooses)."""
    if set(base) != set(new):
        missing, extra = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        raise ManifestMismatch(f"a delta needs the same tensors: base lacks {missing[:3]}, has extra {extra[:3]}")
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
    records: dict[str, bytes] = {}
    kinds: dict[str, DeltaKind] = {}
    full = 0
    for name, tensor in new.items():
        records[name] = encode_tensor_delta(base[name], tensor, compressor)
        kinds[name] = DeltaKind(records[name][0])
        full += tensor.numel() * tensor.element_size()
    return VersionDelta(records, full, kinds)


def apply_delta(
    base: Mapping[str, torch.Tensor], records: Mapping[str, bytes | memoryview], target: VersionIdentity
) -> dict[str, torch.Tensor]:
    """Version N's tensors from `base` (version M, only read) and N's records, verified against N's
    identity before they are returned. Raises DeltaCorrupted on a malformed record and
    DigestMismatch, naming the tensors, when the result is not version N."""
    return apply_delta_identified(base, records, target)[0]


def apply_delta_identified(
    base: Mapping[str, torch.Tensor], records: Mapping[str, bytes | memoryview], target: VersionIdentity
) -> tuple[dict[str, torch.Tensor], VersionIdentity]:
    """`apply_delta`, and the result's identity (per-tensor digests included)."""
    if set(records) != set(base):
        raise ManifestMismatch(f"delta records for {len(records)} tensors, base holds {len(base)}")
    result = {name: apply_tensor_delta(base[name], record, name) for name, record in records.items()}
    got = identify(result)
    if got.digest != target.digest:
        raise DigestMismatch(f"a delta applied to its base is not the version it is for: {got.describe_mismatch(target)}")
    return result, got


def encode_delta_version(
    delta: VersionDelta, version: int, base_version: int, target: VersionIdentity,
    *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> EncodedVersion:
    """`delta` (version `version` from `base_version`) ready to stream like a full version."""
    if not 0 < base_version < version:
        raise ValueError(f"a delta needs 0 < base_version < version, got {base_version} -> {version}")
    records = {name: u8_from_buffer(record) for name, record in delta.records.items()}
    encoded = encode_state_dict(records, version, base_version, chunk_bytes=chunk_bytes)
    for meta in encoded.manifest.tensors:
        meta.digest = target.tensors.get(meta.name, b"")
    encoded.manifest.identity = target.digest
    return encoded


def records_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """The records a delta stream carried, from its assembled UINT8 tensors (no copy)."""
    return {name: byte_view(tensor) for name, tensor in tensors.items()}
