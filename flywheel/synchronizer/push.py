"""A push's frames: payloads in the stream, or in shared memory on the synchronizer's host.

A gRPC stream moves about 1.5 GB/s here and costs both sides CPU per byte
(protobuf bytes, HTTP/2 framing, copies); a trainer on the synchronizer's
host instead writes each chunk's payload into its own shared-memory segment
(`flywheel.transfer.segments.PUSH_SEGMENTS`) and streams only the headers:

    manifest, segment (path, nonce, size), shared_chunk (header, offset, length)...

The synchronizer maps the segment, copies each chunk out into the version's
own storage and verifies the copy against the chunk's checksum, as it would
a payload from the stream. A synchronizer that cannot map it (another host,
another user, a different /dev/shm) refuses the push before staging
anything (`PUSH_SEGMENT_REFUSED`); the push is then sent again with the
payloads in the stream, and that synchronizer is not offered shared memory
again by this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from flywheel.codec import EncodedVersion
from flywheel.errors import FailedPrecondition
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import manifest_frame
from flywheel.transfer.segments import HEADER_BYTES, PUSH_SEGMENT_REFUSED, PUSH_SEGMENTS, OwnedSegment, PushSegments

log = logging.getLogger(__name__)

#: Synchronizers that could not map this process's segment: pushed to over the stream only.
_UNMAPPABLE: set[str] = set()
#: One push at a time writes the process's segment; another meanwhile goes over the stream.
_SEGMENT_IN_USE = threading.Lock()


def refused_shared_memory(error: Exception) -> bool:
    """Whether a push failed only because the synchronizer cannot map its segment."""
    return isinstance(error, FailedPrecondition) and PUSH_SEGMENT_REFUSED in str(error)


def remember_unmappable(synchronizer: str, error: Exception) -> None:
    """Pushes to `synchronizer` go over the stream from now on, and the
    segment's memory is given back (made again if a synchronizer on this host wants it)."""
    _UNMAPPABLE.add(synchronizer)
    PUSH_SEGMENTS.close()
    log.info("the synchronizer cannot map this process's shared memory; pushing over the stream",
             extra={"synchronizer": synchronizer, "reason": str(error)})


class SharedPush:
    """Holds the process's push segment for one push (`with`), or None
    where shared memory is off, unmappable, busy or cannot be made."""

    def __init__(self, synchronizer: str, encoded: EncodedVersion, enabled: bool,
                 segments: PushSegments | None = None) -> None:
        self.synchronizer, self.encoded, self.enabled = synchronizer, encoded, enabled
        self.segments = segments or PUSH_SEGMENTS
        self._locked = False

    def __enter__(self) -> OwnedSegment | None:
        if not self.enabled or self.synchronizer in _UNMAPPABLE or not self.encoded.manifest.total_bytes:
            return None
        if not _SEGMENT_IN_USE.acquire(blocking=False):
            return None
        self._locked = True
        return self.segments.get(self.encoded.manifest.total_bytes)

    def __exit__(self, *exc: object) -> None:
        if self._locked:
            _SEGMENT_IN_USE.release()
            self._locked = False


def shared_frames(encoded: EncodedVersion, segment: OwnedSegment) -> Iterator[bytes]:
    """The manifest, the segment, then each chunk's header once its payload is in the segment."""
    yield manifest_frame(encoded.manifest)
    yield pb.PushWeightsRequest(segment=pb.SharedSegment(
        path=str(segment.path), nonce=segment.nonce, size=segment.size, header_bytes=HEADER_BYTES,
    )).SerializeToString()
    offset = 0
    for header, payload in encoded.pieces():
        n = len(payload)
        segment.payload[offset : offset + n] = payload  # written before its header is sent: cut-through
        yield pb.PushWeightsRequest(
            shared_chunk=pb.SharedChunk(chunk=header, segment_offset=offset, length=n)
        ).SerializeToString()
        offset += n
