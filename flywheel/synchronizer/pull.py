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

A reader that holds a verified version on the host may offer it as a base
(`DeltaBase`): the synchronizer then sends what changed since
(`flywheel.codec.delta`), and the records are applied to the base and the
result verified against the version's identity before `into` is touched. A
synchronizer that no longer holds the base sends the full version.

A stream that breaks (UNAVAILABLE: a dropped connection, a restarted proxy)
is resumed from the first chunk not received, on a new call: chunks already
received stay staged and are not sent again. The manifest's digest must be
the same on the resumed stream, so the chunks put together are one version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import grpc
import torch

from flywheel.codec import WeightAssembler
from flywheel.codec.delta import apply_delta_identified, records_of
from flywheel.codec.dtypes import dtype_to_proto
from flywheel.codec.identity import VersionIdentity, manifest_identity
from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import DataLoss
from flywheel.synchronizer.client_types import DeltaBase, PullStats
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.compression import decompressed
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


#: Times one pull resumes a broken stream before it gives up.
MAX_RESUMES = 8
#: Payload bytes a second below which a pull from a synchronizer asks for compressed chunks
#: (`compress=None`): half the rate at which compression stops paying for bfloat16 weights on two
#: cores (flywheel.transfer.compression), so that a fast LAN or the same host never pays for it.
COMPRESS_BELOW_BYTES_PER_SECOND = 50e6
#: Synchronizer address -> payload bytes a second of the last pull over its stream.
_LINK_RATES: dict[str, float] = {}


def resume_delay(attempt: int) -> float:
    """Seconds to wait before resume `attempt` (from 1): the channel may still hold the broken
    connection for a moment, and a resume sent at once can fail the same way."""
    return min(2.0, 0.05 * 2**attempt)


def wants_compression(synchronizer: str) -> bool:
    """Whether a pull from `synchronizer` should ask for compressed chunks: its link, as the last
    pull over the stream measured it, is slow (unknown: not)."""
    rate = _LINK_RATES.get(synchronizer)
    return rate is not None and rate < COMPRESS_BELOW_BYTES_PER_SECOND


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
    base: DeltaBase | None = None,
    stats: PullStats | None = None,
    compress: bool | None = None,
    retry_unreached: bool = True,
) -> tuple[cpb.WeightManifest, dict[str, torch.Tensor]]:
    """Pulls `request`'s version from `synchronizer` (its address) and assembles it.

    shared_memory: offer to read payloads in place (False: always in the stream).
    check_manifest runs before any chunk is received (raise to refuse the
    version; a delta's is checked as the full version it rebuilds). `into`:
    tensors updated in place on success, untouched otherwise; None returns
    fresh CPU tensors. `staging`: reusable staging tensors (see
    WeightAssembler). `base`: a version this reader holds, to be sent a delta
    from. `stats` is filled in with what the pull cost. `compress`: ask for
    compressed chunks (None: when the link to `synchronizer` proved slow,
    `wants_compression`). `retry_unreached` False: a source that cannot be
    reached at all (UNAVAILABLE before its manifest) fails at once, for the
    caller to try another (a nearby relay or peer, the synchronizer after them);
    True: asked again, up to MAX_RESUMES times (a synchronizer restarting). A
    stream that broke once it began is resumed either way. Every call is
    cancelled on return, on error and on cancellation.
    """
    stats = stats if stats is not None else PullStats()
    shared = shared_memory and synchronizer not in _UNMAPPABLE
    ask = pb.PullWeightsRequest()
    ask.CopyFrom(request)
    ask.shared_memory = shared
    ask.compress = wants_compression(synchronizer) if compress is None else compress
    stats.compressed = ask.compress
    started = time.monotonic()
    if base is not None:
        ask.base_version, ask.base_identity = base.version, base.identity.digest
    receiver = _Receiver(check_manifest, into, staging, maps, base, stats)
    try:
        while True:
            try:
                await receiver.receive(open_call(ask))
                break
            except _Unmappable as exc:
                _UNMAPPABLE.add(synchronizer)
                log.info("synchronizer's shared memory is not reachable from here; pulling over the stream",
                         extra={"synchronizer": synchronizer, "reason": str(exc)})
                # The exact version it offered: a newer one may have been pushed meanwhile.
                receiver.abandon()
                receiver = _Receiver(check_manifest, into, staging, maps, base, stats)
                ask = _again(request, exc.version, base)
                ask.compress = stats.compressed
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or receiver.segment is not None \
                        or stats.resumes >= MAX_RESUMES or (receiver.manifest is None and not retry_unreached):
                    raise
                stats.resumes += 1
                await asyncio.sleep(resume_delay(stats.resumes))
                manifest = receiver.manifest
                if manifest is None:  # broke before anything arrived: nothing to keep, ask again
                    continue
                log.info("the pull stream broke; resuming it", extra={
                    "synchronizer": synchronizer, "version": manifest.version, "from_chunk": receiver.handed,
                    "of_chunks": manifest.chunk_count, "error": exc.details()})
                ask = _again(request, manifest.version, base)
                ask.resume_from, ask.resume_digest = receiver.handed, manifest.digest
                ask.compress = stats.compressed
                if manifest.base_version == 0:
                    ask.base_version, ask.base_identity = 0, b""  # resume what is being sent: the full version
        result = await receiver.finish()
        seconds = time.monotonic() - started
        if (not stats.shared_bytes and stats.stream_bytes >= (1 << 20) and not stats.delta_base
                and not request.wait_seconds and seconds > 0):  # a wait for the push would read as a slow link
            # Payload bytes a second as they arrived (compressed or not): what the link gave this pull.
            _LINK_RATES[synchronizer] = result[0].total_bytes / seconds
        return result
    except BaseException:
        await asyncio.to_thread(receiver.abandon)
        raise


def _again(request: pb.PullWeightsRequest, version: int, base: DeltaBase | None) -> pb.PullWeightsRequest:
    again = pb.PullWeightsRequest(version=version, wait_seconds=request.wait_seconds)
    if base is not None:
        again.base_version, again.base_identity = base.version, base.identity.digest
    return again


def _as_full(manifest: cpb.WeightManifest, tensors: Mapping[str, torch.Tensor],
             identity: VersionIdentity | None = None) -> cpb.WeightManifest:
    """What a delta manifest rebuilds: the version with these tensors' specs (the base's, for
    `check_manifest`: a delta only applies to a base of the same names, dtypes and shapes; the
    result's, with its verified identity, for the caller)."""
    digests = identity.tensors if identity is not None else {}
    full = cpb.WeightManifest(version=manifest.version, identity=manifest.identity, tensors=[
        cpb.TensorMeta(name=name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape),
                       nbytes=t.numel() * t.element_size(), digest=digests.get(name, b""))
        for name, t in tensors.items()
    ])
    full.total_bytes = sum(t.nbytes for t in full.tensors)
    return full


class _Receiver:
    """One version's assembly, across the streams of a pull (a resumed stream continues it)."""

    def __init__(self, check_manifest, into, staging, maps: SegmentMaps, base: DeltaBase | None,
                 stats: PullStats) -> None:
        self.check_manifest = check_manifest
        self.into, self.staging, self.maps, self.base, self.stats = into, staging, maps, base, stats
        self.manifest: cpb.WeightManifest | None = None
        self.assembler: WeightAssembler | None = None
        self.segment: memoryview | None = None
        self.committed = False
        #: Chunks handed to the assembler, in sequence order: where a resumed stream starts.
        self.handed = 0

    async def receive(self, call: PullCall) -> None:
        """Reads one stream to its end (or the shared-memory commit) into the assembly."""
        try:
            async for frame in call:
                field = frame[0] >> 3 if frame else 0  # every field number here fits one key byte
                if field == MANIFEST_FIELD:
                    self._start(cpb.WeightManifest.FromString(bytes(split_frame(frame)[1])))
                elif self.assembler is None:
                    raise DataLoss("the pull stream did not start with a manifest")
                elif field == CHUNK_FIELD:
                    header, payload = parse_chunk(split_frame(frame)[1])
                    if header.sequence != self.handed:
                        raise DataLoss(f"the pull stream sent chunk {header.sequence}, expected {self.handed}")
                    self.stats.stream_bytes += len(payload)
                    if header.zstd:
                        payload = decompressed(header, payload, self.manifest.chunk_bytes)
                        header.zstd = False
                    self.assembler.add_piece(header, payload)
                    self.handed += 1
                else:
                    message = pb.PullWeightsResponse.FromString(frame)
                    kind = message.WhichOneof("payload")
                    if kind == "segment":
                        self.segment = _map(message.segment, self.assembler, self.maps)
                    elif kind == "shared_chunk" and self.segment is not None:
                        self.assembler.add_piece(message.shared_chunk.chunk, _slice(self.segment, message.shared_chunk))
                        self.handed += 1
                        self.stats.shared_bytes += message.shared_chunk.length
                    elif kind == "committed" and self.segment is not None:
                        self.committed = True
                        break  # the server holds the segment until we hang up, after commit
                    else:
                        raise DataLoss(f"unexpected {kind or 'empty'} message in the pull stream")
            if self.assembler is None:
                raise DataLoss("the pull stream ended before its manifest")
            if self.segment is not None and not self.committed:
                raise DataLoss("the shared-memory pull ended before the version was committed")
        finally:
            call.cancel()

    def _start(self, manifest: cpb.WeightManifest) -> None:
        if self.manifest is not None:  # a resumed stream: it must go on with the same chunks
            if manifest.digest != self.manifest.digest:
                raise DataLoss("the resumed pull stream is another version's (its digest differs)")
            return
        if manifest.base_version:
            if self.base is None or manifest.base_version != self.base.version:
                raise DataLoss(f"the synchronizer sent a delta from version {manifest.base_version}, "
                               f"which this reader did not offer")
            if len(manifest.identity) != 16:
                raise DataLoss("the synchronizer sent a delta without the identity of the version it rebuilds")
            if self.check_manifest is not None:
                self.check_manifest(_as_full(manifest, self.base.tensors))
            # Records are small: staged in fresh tensors, applied to the base at finish.
            self.assembler = WeightAssembler(manifest, None, stage_in_background=True)
            self.stats.delta_base = manifest.base_version
        else:
            if self.check_manifest is not None:
                self.check_manifest(manifest)
            self.assembler = WeightAssembler(manifest, self.into, staging=self.staging, stage_in_background=True)
        self.manifest = manifest

    async def finish(self) -> tuple[cpb.WeightManifest, dict[str, torch.Tensor]]:
        """Waits for the background copies, verifies the digest (and a delta's result against the
        version's identity), then writes `into`."""
        assert self.assembler is not None and self.manifest is not None
        manifest = self.manifest
        if not manifest.base_version:
            return manifest, await asyncio.to_thread(self.assembler.commit)
        return await asyncio.to_thread(self._apply_delta, self.assembler.commit())

    def _apply_delta(self, records: dict[str, torch.Tensor]) -> tuple[cpb.WeightManifest, dict[str, torch.Tensor]]:
        """The version the records rebuild, verified, and its manifest as a full version's (the
        caller sees the version; `stats.delta_base` says how it travelled)."""
        assert self.base is not None and self.manifest is not None
        rebuilt, identity = apply_delta_identified(
            self.base.tensors, records_of(records), manifest_identity(self.manifest))
        manifest = _as_full(self.manifest, rebuilt, identity)
        target = self.into if self.into is not None else self.staging
        if target is None:
            return manifest, rebuilt
        for name, tensor in rebuilt.items():
            target[name].copy_(tensor)
        return manifest, dict(target)

    def abandon(self) -> None:
        """Waits until nothing reads the payloads or writes staging any more (idempotent)."""
        if self.assembler is not None:
            self.assembler.abandon()


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
