"""Where a weight version's chunk payloads live while the synchronizer holds it.

* `HeapFrames`: the frames exactly as the trainer pushed them; a pull writes
  those very bytes back (no copy at all). Used when shared memory is off or
  unavailable.
* `SegmentFrames`: each verified payload is copied once into a shared-memory
  segment (`flywheel.transfer.segments`); a reader on this host maps the
  segment and gets only headers over the stream, a remote reader gets each
  frame rebuilt from the segment (one copy per chunk, ~0.05 CPU-s/GB, small
  beside the ~0.6 CPU-s/GB gRPC spends sending it).

`SegmentPool` hands segments out and takes them back, so that versions of
one model reuse the same few files: their pages stay mapped in the
synchronizer and in every reader, and a transfer never page-faults a
model's worth of fresh memory in.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import chunk_frame
from flywheel.transfer.segments import HEADER_BYTES, OwnedSegment, sweep_stale

log = logging.getLogger(__name__)


class HeapFrames:
    segment: OwnedSegment | None = None

    def __init__(self, count: int) -> None:
        self._frames: list[bytes | None] = [None] * count
        self.held_bytes = 0

    def landing(self, n: int) -> memoryview:
        """Where a chunk's payload copied from shared memory goes before it is verified."""
        return memoryview(bytearray(n))

    def put(self, seq: int, frame: bytes, header: common_pb2.WeightChunk, data: memoryview,
            landed: bool = False) -> None:
        frame = frame or chunk_frame(header, data)
        self._frames[seq] = frame
        self.held_bytes += len(frame)

    def has(self, seq: int) -> bool:
        return self._frames[seq] is not None

    def frame(self, seq: int) -> bytes:
        frame = self._frames[seq]
        assert frame is not None
        return frame

    def release(self) -> None:
        self._frames = []
        self.held_bytes = 0


class SegmentFrames:
    def __init__(self, count: int, segment: OwnedSegment) -> None:
        self.segment = segment
        self._headers: list[common_pb2.WeightChunk | None] = [None] * count
        self._places: list[tuple[int, int]] = [(0, 0)] * count
        self._shared: list[bytes] = [b""] * count
        self._end = 0
        self.held_bytes = segment.size

    def landing(self, n: int) -> memoryview:
        """The next chunk's place in the segment: a payload copied from shared
        memory lands here, is verified here, then `put(..., landed=True)`."""
        start = self._end
        if start + n > self.segment.size:  # the checker bounds the total; this guards the segment
            raise DataLoss(f"a chunk of {n} bytes overruns the version's {self.segment.size} payload bytes")
        return self.segment.payload[start : start + n]

    def put(self, seq: int, frame: bytes, header: common_pb2.WeightChunk, data: memoryview,
            landed: bool = False) -> None:
        start, n = self._end, len(data)
        if not landed:
            self.landing(n)[:] = data
        self._end = start + n
        self._places[seq] = (start, n)
        self._shared[seq] = pb.PullWeightsResponse(
            shared_chunk=pb.SharedChunk(chunk=header, segment_offset=start, length=n)
        ).SerializeToString()
        self._headers[seq] = header

    def has(self, seq: int) -> bool:
        return self._headers[seq] is not None

    def frame(self, seq: int) -> bytes:
        header = self._headers[seq]
        assert header is not None
        start, n = self._places[seq]
        return chunk_frame(header, self.segment.payload[start : start + n])

    def shared_frame(self, seq: int) -> bytes:
        return self._shared[seq]

    def segment_frame(self) -> bytes:
        s = self.segment
        return pb.PullWeightsResponse(
            segment=pb.SharedSegment(path=str(s.path), nonce=s.nonce, size=s.size, header_bytes=HEADER_BYTES)
        ).SerializeToString()

    def release(self) -> None:
        self._headers, self._shared = [], []
        self.held_bytes = 0


class SegmentPool:
    """Segments for versions in `directory`, reused; at most `max_segments`
    are kept (held by versions or free)."""

    def __init__(self, directory: Path, max_segments: int) -> None:
        self.directory = directory
        self.max_segments = max_segments
        self._free: list[OwnedSegment] = []
        self._all: list[OwnedSegment] = []
        self._in_use = 0
        self._warned = False
        for path in sweep_stale(directory):
            log.info("removed a stale weight segment", extra={"path": str(path)})

    def acquire(self, size: int) -> OwnedSegment | None:
        """A segment of exactly `size` payload bytes, or None (the caller keeps the
        version on the heap) when the directory cannot hold one."""
        fits = next((s for s in self._free if s.size == size), None)
        if fits is not None:
            self._free.remove(fits)
        else:
            while self._free and self._in_use + len(self._free) >= self.max_segments:
                self._close(self._free.pop(0))  # another model size: make room
            try:
                fits = OwnedSegment(self.directory, size)
                self._all.append(fits)
            except OSError as exc:
                if not self._warned:  # e.g. a container's 64 MiB /dev/shm
                    log.warning(
                        "shared memory unavailable; versions are kept on the heap and pulled over gRPC only",
                        extra={"directory": str(self.directory), "bytes": size, "error": str(exc)},
                    )
                    self._warned = True
                return None
        self._in_use += 1
        return fits

    def release(self, segment: OwnedSegment) -> None:
        self._in_use -= 1
        if self._in_use + len(self._free) >= self.max_segments:
            self._close(segment)
        else:
            self._free.append(segment)

    @property
    def free_bytes(self) -> int:
        """Bytes of free segments kept for reuse (memory the process holds)."""
        return sum(s.size for s in self._free)

    def _close(self, segment: OwnedSegment) -> None:
        segment.close()
        self._all.remove(segment)

    def close(self) -> None:
        """Removes every segment, held or free (at shutdown)."""
        for segment in self._all:
            segment.close()
        self._all, self._free = [], []


def open_pool(directory: str, max_segments: int) -> SegmentPool | None:
    """The pool for `directory` (the config's shared_memory_dir), or None when
    shared memory is off or the directory is unusable."""
    if not directory:
        return None
    path = Path(directory)
    if not path.is_dir() or not os.access(path, os.W_OK):
        log.warning("shared_memory_dir is not a writable directory; versions stay on the heap",
                    extra={"directory": directory})
        return None
    return SegmentPool(path, max_segments)
