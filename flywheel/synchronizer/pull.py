"""The receiving end of PullWeights: raw response frames in, one verified
version out (all or nothing). Every pull goes through here, by way of the
synchronizer's typed client (`flywheel.synchronizer.client`; the rollout's
pulls too).

A pull asks for shared memory. When the synchronizer holds the version in
a segment this process can map (same host), the stream carries only chunk
headers and each payload is copied straight out of the mapping; otherwise
payloads come in the stream. Either way every chunk goes through the
codec's `WeightAssembler`: staged on the codec's pool (the event loop only
reads headers), checked against its checksum after the copy, and the digest
is checked before `into` is touched. A segment the reader cannot map (another
host, a private /dev/shm) costs one round trip: the pull is asked again
without shared memory, and that synchronizer is not offered it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import torch

from flywheel.codec import WeightAssembler
from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import DataLoss
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import CHUNK_FIELD, MANIFEST_FIELD, split_frame
from flywheel.transfer.segments import SEGMENT_MAPS, SegmentMaps, SegmentUnavailable

log = logging.getLogger(__name__)

#: Synchronizers whose segments this process could not map: pulled over the stream only.
_UNMAPPABLE: set[str] = set()


class PullCall(Protocol):
    """A PullWeights call with raw (undeserialized) responses."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def cancel(self) -> bool: ...


class _Unmappable(Exception):
    def __init__(self, version: int, reason: SegmentUnavailable) -> None:
        super().__init__(str(reason))
        self.version = version


async def pull_version(
    open_call: Callable[[pb.PullWeightsRequest], PullCall],
    request: pb.PullWeightsRequest,
    *,
    synchronizer: str,
    shared_memory: bool = True,
    check_manifest: Callable[[cpb.WeightManifest], None] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    staging: Mapping[str, torch.Tensor] | None = None,
    maps: SegmentMaps = SEGMENT_MAPS,
) -> tuple[cpb.WeightManifest, dict[str, torch.Tensor]]:
    """Pulls `request`'s version from `synchronizer` (its address) and assembles it.

    shared_memory: offer to read payloads in place (False: always in the stream).
    check_manifest runs before any chunk is received (raise to refuse the
    version). `into`: tensors updated in place on success, untouched
    otherwise; None returns fresh CPU tensors. `staging`: reusable staging
    tensors (see WeightAssembler). The call is cancelled on return, on
    error and on cancellation.
    """
    shared = shared_memory and synchronizer not in _UNMAPPABLE
    ask = pb.PullWeightsRequest()
    ask.CopyFrom(request)
    ask.shared_memory = shared
    try:
        return await _receive(open_call(ask), check_manifest, into, staging, maps)
    except _Unmappable as exc:
        _UNMAPPABLE.add(synchronizer)
        log.info("synchronizer's shared memory is not reachable from here; pulling over the stream",
                 extra={"synchronizer": synchronizer, "reason": str(exc)})
        # The exact version it offered: a newer one may have been pushed meanwhile.
        again = pb.PullWeightsRequest(version=exc.version, wait_seconds=request.wait_seconds)
        return await _receive(open_call(again), check_manifest, into, staging, maps)


async def _receive(
    call: PullCall,
    check_manifest: Callable[[cpb.WeightManifest], None] | None,
    into: Mapping[str, torch.Tensor] | None,
    staging: Mapping[str, torch.Tensor] | None,
    maps: SegmentMaps,
) -> tuple[cpb.WeightManifest, dict[str, torch.Tensor]]:
    assembler: WeightAssembler | None = None
    segment: memoryview | None = None
    committed = False
    try:
        try:
            async for frame in call:
                field = frame[0] >> 3 if frame else 0  # every field number here fits one key byte
                if field == MANIFEST_FIELD:
                    if assembler is not None:
                        raise DataLoss("the pull stream sent a second manifest")
                    manifest = cpb.WeightManifest.FromString(bytes(split_frame(frame)[1]))
                    if check_manifest is not None:
                        check_manifest(manifest)
                    assembler = WeightAssembler(manifest, into, staging=staging, stage_in_background=True)
                elif assembler is None:
                    raise DataLoss("the pull stream did not start with a manifest")
                elif field == CHUNK_FIELD:
                    assembler.add_piece(*parse_chunk(split_frame(frame)[1]))
                else:
                    message = pb.PullWeightsResponse.FromString(frame)
                    kind = message.WhichOneof("payload")
                    if kind == "segment":
                        segment = _map(message.segment, assembler, maps)
                    elif kind == "shared_chunk" and segment is not None:
                        assembler.add_piece(message.shared_chunk.chunk, _slice(segment, message.shared_chunk))
                    elif kind == "committed" and segment is not None:
                        committed = True
                        break  # the server holds the segment until we hang up, after commit
                    else:
                        raise DataLoss(f"unexpected {kind or 'empty'} message in the pull stream")
            if assembler is None:
                raise DataLoss("the pull stream ended before its manifest")
            if segment is not None and not committed:
                raise DataLoss("the shared-memory pull ended before the version was committed")
            # Waits for the background copies out of the stream or the segment,
            # verifies the digest, then writes `into`.
            tensors = await asyncio.to_thread(assembler.commit)
        except BaseException:
            if assembler is not None:
                await asyncio.to_thread(assembler.abandon)
            raise
    finally:
        call.cancel()
    return assembler.manifest, tensors


def _map(segment: pb.SharedSegment, assembler: WeightAssembler, maps: SegmentMaps) -> memoryview:
    if segment.size != assembler.manifest.total_bytes:
        raise DataLoss(f"segment of {segment.size} bytes for a version of {assembler.manifest.total_bytes}")
    try:
        return maps.open(segment.path, segment.nonce, segment.size, segment.header_bytes)
    except SegmentUnavailable as exc:
        raise _Unmappable(assembler.version, exc) from None


def _slice(segment: memoryview, chunk: pb.SharedChunk) -> memoryview:
    start, end = chunk.segment_offset, chunk.segment_offset + chunk.length
    if end > len(segment):
        raise DataLoss(f"chunk {chunk.chunk.sequence} lies past the segment's end ({end} > {len(segment)})")
    return segment[start:end]
