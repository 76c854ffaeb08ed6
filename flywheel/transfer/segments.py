"""Shared-memory segments: weight payloads a process on the same host reads in place.

A pull over gRPC costs both sides about 0.6 CPU-s per GB (protobuf bytes,
HTTP/2 framing, copies); a reader on the synchronizer's host can instead map
the file the payloads were written to and copy each chunk straight into its
staging tensors (measured here: 13 GB/s for a reused segment). The stream
then carries only chunk headers, and every chunk is still checked against
its checksum after the copy, so a reader never trusts the mapping's bytes.

A segment is a file in a memory-backed directory (`/dev/shm`):

    [header: magic, nonce, payload size][payload region: size bytes]

* The owner (the synchronizer) reserves the whole file up front
  (`posix_fallocate`), so a full tmpfs fails at creation with ENOSPC instead
  of killing the process with SIGBUS on a later write.
* The owner holds an exclusive `flock` on it for the segment's life: a file
  no process holds is a leftover of a crashed owner, and `sweep_stale`
  removes it (flock works across PID namespaces, e.g. containers sharing
  a volume).
* The nonce (random, per file) tells a reader that the file it mapped is the
  one the stream named, not a same-named file on another host.
* Segments are reused from version to version: readers keep their maps open
  (`SegmentMaps`), so a reused segment is read with no page faults.

The same layout carries pushes the other way: a trainer on the
synchronizer's host writes each version into its own segment
(`PUSH_SEGMENTS`, reused from push to push) and streams only the headers;
the synchronizer copies every chunk out before it verifies it, so a writer
that changes its segment afterwards cannot change what was checked.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"FLYWSEG1"
HEADER_BYTES = 4096  # one page: the payload region stays page-aligned
PREFIX = "flywheel-weights-"
_NONCE_BYTES = 16
_LAYOUT = struct.Struct(f"<8s{_NONCE_BYTES}sQ")  # magic, nonce, payload size


#: How a synchronizer that cannot map a pusher's segment starts its refusal
#: (FAILED_PRECONDITION, before it staged anything): the pusher then sends the
#: payloads in the stream.
PUSH_SEGMENT_REFUSED = "cannot map the pusher's shared memory"

#: Where a pusher makes its segment: memory-backed on Linux.
DEFAULT_DIRECTORY = Path("/dev/shm")


class SegmentUnavailable(Exception):
    """The reader cannot use the named segment (another host, a recycled
    or removed file): it should pull the bytes over the stream instead."""


class OwnedSegment:
    """A segment this process created and writes (the synchronizer's side)."""

    def __init__(self, directory: Path, size: int) -> None:
        self.size = size
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        name = f"{PREFIX}{uuid.uuid4().hex}"
        # Created under a name sweep_stale ignores, and renamed only once
        # locked: a concurrent sweep can never take a new segment for stale.
        draft = directory / f".draft-{name}"
        fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, HEADER_BYTES + size)
            self._map = mmap.mmap(fd, HEADER_BYTES + size)
            self.path = directory / name
            os.rename(draft, self.path)
        except BaseException:
            os.close(fd)
            draft.unlink(missing_ok=True)
            raise
        self._fd = fd
        # A segment dropped without close() (a test, an error path) still
        # leaves no file behind for long.
        self._finalizer = weakref.finalize(self, _remove, self.path, fd)
        self._map[: _LAYOUT.size] = _LAYOUT.pack(MAGIC, self.nonce, size)
        self.payload = memoryview(self._map)[HEADER_BYTES:]

    def close(self) -> None:
        """Unmaps, unlinks and unlocks the segment (readers' open maps stay valid)."""
        if self._fd < 0:
            return
        self._finalizer.detach()
        try:
            self.payload.release()
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the map goes with it
        _remove(self.path, self._fd)
        self._fd = -1


def _remove(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)


def sweep_stale(directory: Path) -> list[Path]:
    """Removes segments no live owner holds (left by a crashed process)."""
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)  # also drops the lock we may have taken
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class _Mapped:
    def __init__(self, path: str) -> None:
        # Never follows a link, never blocks on a FIFO: the path comes from a peer.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{path} is not a regular file")
            self.inode = os.fstat(fd).st_ino
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the map keeps the file alive
        self.view = memoryview(self.map)


class SegmentMaps:
    """The reader's side: read-only maps of segments, kept open across pulls
    (at most `max_open`, least recently used dropped first)."""

    def __init__(self, max_open: int = 8) -> None:
        self.max_open = max_open
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()

    @property
    def paths(self) -> list[str]:
        """The segments mapped now, least recently used first."""
        return list(self._maps)

    def open(self, path: str, nonce: bytes, size: int, header_bytes: int) -> memoryview:
        """The payload region of the segment at `path`, checked against the
        stream's nonce and size; raises SegmentUnavailable otherwise."""
        if header_bytes != HEADER_BYTES:
            raise SegmentUnavailable(f"segment layout with a {header_bytes}-byte header is not this reader's")
        try:
            mapped = self._current(path)
        except (OSError, ValueError) as exc:
            raise SegmentUnavailable(f"cannot map {path}: {exc}") from None
        if len(mapped.map) < HEADER_BYTES + size:
            raise SegmentUnavailable(f"{path} holds {len(mapped.map) - HEADER_BYTES} payload bytes, not {size}")
        magic, got, _ = _LAYOUT.unpack_from(mapped.map, 0)
        if magic != MAGIC or got != nonce:
            raise SegmentUnavailable(f"{path} is not the segment the stream named (another host's, or replaced)")
        return mapped.view[HEADER_BYTES : HEADER_BYTES + size]

    def _current(self, path: str) -> _Mapped:
        self._drop_removed(path)
        mapped = self._maps.get(path)
        if mapped is not None and os.stat(path).st_ino == mapped.inode:
            self._maps.move_to_end(path)
            return mapped
        mapped = _Mapped(path)
        self._maps[path] = mapped
        while len(self._maps) > self.max_open:
            self._maps.popitem(last=False)  # unmapped once no staging copy still reads it
        return mapped

    def _drop_removed(self, keep: str) -> None:
        """Unmaps segments their owner removed: a map keeps a deleted file's
        memory allocated (a model's worth each) for as long as it exists."""
        for path, mapped in list(self._maps.items()):
            if path == keep:
                continue
            try:
                current = os.stat(path).st_ino == mapped.inode
            except OSError:
                current = False
            if not current:
                del self._maps[path]


#: The process's maps: every pull in a process shares them.
SEGMENT_MAPS = SegmentMaps()


class PushSegments:
    """The pusher's side: one segment per size, reused from push to push (a
    fresh one costs a page fault per page: about the price of the copy
    itself). It holds a whole version in `directory` for the process's life,
    so a process that cannot spare that memory pushes over the stream
    (`shared_memory=False` on its client). Pushes through it take turns: a
    segment is rewritten only once the synchronizer answered the last push,
    by which time it copied every chunk out."""

    def __init__(self, directory: Path = DEFAULT_DIRECTORY) -> None:
        self.directory = directory
        self._segment: OwnedSegment | None = None
        self._failed_size = -1  # a size creation failed for (a full /dev/shm): not retried

    def get(self, size: int) -> OwnedSegment | None:
        """A segment of exactly `size` payload bytes, or None where none can be made."""
        if self._segment is not None and self._segment.size == size:
            return self._segment
        if size == self._failed_size or size == 0:
            return None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        try:
            self._segment = OwnedSegment(self.directory, size)
        except OSError as exc:
            self._failed_size = size
            log.warning("no shared memory for pushes; they go over the stream",
                        extra={"directory": str(self.directory), "bytes": size, "error": str(exc)})
            return None
        return self._segment

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


#: The process's push segments.
PUSH_SEGMENTS = PushSegments()
