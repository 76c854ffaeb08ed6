"""Shared helpers of the synchronizer tests: small state dicts and their frames."""

from __future__ import annotations

import torch

from flywheel.codec import encode_state_dict
from flywheel.codec.wire import parse_chunk
from flywheel.synchronizer.types import UpdateCoverage, UpdateOutcome, UpdateRecord
from flywheel.transfer.frames import encoded_frames, split_frame


def small_state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64 * scale, 48, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(48, generator=g),
        "layer.0.scale": torch.tensor(1.5),
        "layer.0.empty": torch.zeros(0, 4),
        "layer.0.ids": torch.arange(33, dtype=torch.int64),
    }


def frames_of(state: dict[str, torch.Tensor], version: int, chunk_bytes: int = 1000, bucket_bytes: int = 4000):
    """(manifest, manifest frame, [(frame, header, payload)]) of a version."""
    encoded = encode_state_dict(state, version, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes)
    frames = list(encoded_frames(encoded))
    chunks = []
    for frame in frames[1:]:
        _, inner = split_frame(frame)
        chunks.append((frame, *parse_chunk(inner)))
    return encoded.manifest, frames[0], chunks


def corrupt(frame: bytes) -> bytes:
    """The frame with its last payload byte flipped (the payload is the frame's tail)."""
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


def measured_all(tensors: int, nbytes: int = 1) -> UpdateCoverage:
    """Coverage of a replica that hashed every one of `tensors` tensors as they sit in its engine."""
    return UpdateCoverage(tensors=tensors, bytes=nbytes, resident_tensors=tensors, resident_bytes=nbytes)


def verified_report(sync, component: str, version: int, resident: bytes | None = None) -> UpdateRecord:
    """A VERIFIED claim of `version` with every tensor measured RESIDENT; `resident` (default: the
    identity the synchronizer recorded) is what the replica measured."""
    record = sync.catalog.records.get(version)
    identity = resident if resident is not None else record.identity
    count = len(record.tensors) if record is not None and record.tensors else 1
    return UpdateRecord(component, version, UpdateOutcome.VERIFIED, resident_identity=identity,
                        coverage=measured_all(count), served_version=version)
