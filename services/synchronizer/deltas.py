"""Delta versions: a replica that holds version M asks for N "from M", and is
streamed only what changed (`flywheel.codec.delta`), verified on its side
against N's identity before anything loads.

The synchronizer makes deltas, not the publisher: only it knows which bases
replicas hold (a lagging replica's base is not the previous version), and a
delta made once here serves every replica that holds the same base. It is
made on demand from the two committed buffers (both decoded, the records
encoded in a worker thread: about a second for a 0.5 GB model on two cores)
and kept in a small cache, so the replicas of a fleet that ask for the same
step share one computation and one copy. A delta is streamed as an ordinary
committed `VersionBuffer` (the same chunk checksums, digest and resumable
stream as a full version).

The answer falls back to the full version, and says why in the log and the
`flywheel_synchronizer_delta_pulls_total` metric, when the base is no longer
held, its identity is not the one the replica claims (another lineage after a
rewind, or weights that drifted), the tensors differ in name, dtype or shape,
or the delta would not be smaller than the version.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flywheel.codec import WeightAssembler
from flywheel.codec.delta import encode_delta, encode_delta_version
from flywheel.codec.identity import manifest_identity
from flywheel.codec.wire import parse_chunk
from flywheel.errors import InvalidArgument
from flywheel.transfer.frames import encoded_frames, split_frame
from services.synchronizer import metrics
from services.synchronizer.buffers import Phase, VersionBuffer

log = logging.getLogger(__name__)

#: A delta this close to the full version's size is not worth the replica's apply: send the version.
WORTH_FRACTION = 0.9


@dataclass(frozen=True)
class DeltaKey:
    base_version: int
    base_identity: bytes
    version: int
    identity: bytes


def decode(buffer: VersionBuffer) -> dict[str, torch.Tensor]:
    """The tensors of a committed buffer (fresh CPU tensors; every chunk checked again on the way)."""
    assembler = WeightAssembler(buffer.manifest)
    for seq in range(buffer.verifier.count):
        assembler.add_piece(*parse_chunk(split_frame(buffer.storage.frame(seq))[1]))
    return assembler.commit()


def _same_tensors(a: VersionBuffer, b: VersionBuffer) -> bool:
    return [(t.name, t.dtype, list(t.shape)) for t in a.manifest.tensors] == \
        [(t.name, t.dtype, list(t.shape)) for t in b.manifest.tensors]


def _delta_buffer(base: VersionBuffer, target: VersionBuffer) -> VersionBuffer | None:
    """`target` as a committed delta buffer from `base`, or None when it would not be smaller (in a thread)."""
    identity = manifest_identity(target.manifest)
    assert identity is not None  # the caller only asks for versions that carry one
    delta = encode_delta(decode(base), decode(target))
    if delta.nbytes >= WORTH_FRACTION * delta.full_nbytes:
        return None
    encoded = encode_delta_version(delta, target.version, base.version, identity,
                                   chunk_bytes=max(1, target.manifest.chunk_bytes))
    encoded.manifest.probe.CopyFrom(target.manifest.probe)  # what the target is, however it travels
    frames = encoded_frames(encoded)
    first = next(frames)
    buffer = VersionBuffer(encoded.manifest, first)
    for frame in frames:
        buffer.add(frame, *parse_chunk(split_frame(frame)[1]))
    buffer.commit()
    return buffer


class DeltaCache:
    """Deltas made for replicas, newest kept, bounded by bytes and count."""

    def __init__(self, max_bytes: int, max_entries: int = 8,
                 make: Callable[[VersionBuffer, VersionBuffer], VersionBuffer | None] = _delta_buffer) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._make = make
        self._entries: OrderedDict[DeltaKey, asyncio.Future[VersionBuffer | None]] = OrderedDict()

    @property
    def held_bytes(self) -> int:
        return sum(f.result().held_bytes for f in self._entries.values()
                   if f.done() and not f.cancelled() and f.exception() is None and f.result() is not None)

    async def answer(self, target: VersionBuffer, base: VersionBuffer | None, base_version: int,
                     base_identity: bytes) -> VersionBuffer:
        """What to stream to a replica holding `base_version` (identity `base_identity`) that asked for
        `target`: a delta buffer when one applies, else `target` itself."""
        if not base_identity:
            raise InvalidArgument("base_version needs base_identity: a delta is made only from known weights")
        if base_version >= target.version:
            raise InvalidArgument(f"base_version {base_version} is not below the version asked for ({target.version})")
        if target.phase is Phase.STAGING:
            await target.wait_committed()  # a delta needs the whole version (streamed cut-through when full)
        why = self._refusal(target, base, base_identity)
        if why:
            return self._full(target, base_version, why)
        assert base is not None
        key = DeltaKey(base.version, base_identity, target.version, bytes(target.manifest.identity))
        future = self._entries.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._entries[key] = future
            try:
                future.set_result(await asyncio.to_thread(self._make, base, target))
            except BaseException as exc:
                del self._entries[key]
                future.set_exception(exc)
                future.exception()  # retrieved: concurrent askers re-raise it themselves
                raise
            self._trim(keep=key)
        else:
            self._entries.move_to_end(key)
        delta = await asyncio.shield(future)
        if delta is None:
            return self._full(target, base_version, "the delta would not be smaller than the version")
        metrics.DELTA_PULLS.labels("delta").inc()
        return delta

    @staticmethod
    def _refusal(target: VersionBuffer, base: VersionBuffer | None, base_identity: bytes) -> str:
        if base is None or base.phase is not Phase.COMMITTED:
            return "the base version is no longer held"
        if bytes(base.manifest.identity) != base_identity:
            return "the base's identity differs from the replica's (another lineage, or drifted weights)"
        if not target.manifest.identity:
            return "the version carries no identity to verify a delta against"
        if not _same_tensors(base, target):
            return "the tensors' names, dtypes or shapes changed"
        return ""

    @staticmethod
    def _full(target: VersionBuffer, base_version: int, why: str) -> VersionBuffer:
        metrics.DELTA_PULLS.labels("full").inc()
        log.info("sending the full version instead of a delta",
                 extra={"version": target.version, "base_version": base_version, "reason": why})
        return target

    def _trim(self, keep: DeltaKey) -> None:
        """Oldest first, never `keep` (just made for a reader). Keys carry identities, so a delta of
        weights a rewind abandoned is never served for the new lineage's version of the same number;
        it only ages out."""
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.held_bytes > self.max_bytes):
            oldest = next(k for k in self._entries if k != keep)
            future = self._entries.pop(oldest)
            if future.done() and future.exception() is None and future.result() is not None:
                future.result().retire()  # readers streaming it finish first
