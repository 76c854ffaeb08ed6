"""Versioned weight buffers (MEMORY method) with cut-through readers.

A version is held once, whoever reads it: as the frames the trainer pushed
(serialized manifest and chunk messages, see `flywheel.transfer.frames`), or
with its payloads in a shared-memory segment that readers on this host map
(`services.synchronizer.storage`). Checksums are verified as each chunk
lands; concurrent pulls share the one copy.

A `VersionBuffer` starts STAGING and grows chunk by chunk; readers of a
staging version stream each chunk as soon as it is verified (cut-through)
and wait for the rest. `commit` (after the digest check) makes it visible
as the newest version; `abort` drops its frames and fails every reader with
ABORTED. Only committed versions count as served: a broken or abandoned push
leaves no trace. The store keeps the newest `keep` committed versions; an
evicted or aborted version's storage is released once its last reader is
gone (a shared segment is then reused: never while someone reads it).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator

from flywheel.codec import ChunkChecker
from flywheel.common.v1 import common_pb2
from flywheel.errors import (
    Aborted, AlreadyExists, FailedPrecondition, FlywheelError, InvalidArgument, NotFound, ResourceExhausted,
)
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.compression import compressed_frame
from services.synchronizer.storage import HeapFrames, SegmentFrames, SegmentPool

#: The last message of a shared-memory pull.
COMMITTED_FRAME = pb.PullWeightsResponse(committed=True).SerializeToString()


class Phase(enum.Enum):
    STAGING = "staging"
    COMMITTED = "committed"
    ABORTED = "aborted"


class Signal:
    """A level-less broadcast: what `wait()` returns is done at the next `fire()`."""

    def __init__(self) -> None:
        self._future: asyncio.Future | None = None

    def fire(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None

    def wait(self) -> asyncio.Future:
        """Listens from this call on, not from the first await: `asyncio.wait_for(signal.wait(), t)`
        runs its argument in a task of its own, and a fire() before that task's first step was lost
        when wait() was a coroutine (the caller had checked its condition, then slept to `t`)."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._future)


class VersionBuffer:
    def __init__(
        self, manifest: common_pb2.WeightManifest, manifest_frame: bytes, pool: SegmentPool | None = None
    ) -> None:
        self.verifier = ChunkChecker(manifest)  # validates the manifest first
        self.manifest = manifest
        self.version = manifest.version
        self.manifest_frame = manifest_frame
        segment = pool.acquire(manifest.total_bytes) if pool is not None and manifest.total_bytes else None
        self.storage: HeapFrames | SegmentFrames = (
            SegmentFrames(self.verifier.count, segment) if segment is not None
            else HeapFrames(self.verifier.count)
        )
        self._pool = pool
        self.phase = Phase.STAGING
        self.error: FlywheelError | None = None
        self.started = time.monotonic()
        self.committed_unix_ms = 0
        self.readers = 0
        self._retired = False  # evicted or aborted: storage goes once no reader is left
        self._released = False
        self._changed = Signal()

    @property
    def held_bytes(self) -> int:
        return 0 if self._released else len(self.manifest_frame) + self.storage.held_bytes

    @property
    def shared(self) -> bool:
        """Readers on this host can map its payloads."""
        return isinstance(self.storage, SegmentFrames)

    @property
    def payload_bytes(self) -> int:
        return self.manifest.total_bytes

    def add(self, frame: bytes, chunk: common_pb2.WeightChunk, data: memoryview) -> None:
        """Verifies a chunk (codec errors on failure) and makes its frame readable."""
        self._accepting(chunk)
        seq = self.verifier.check(chunk, data)
        self.storage.put(seq, frame, chunk, data)
        self._changed.fire()

    def add_copied(self, chunk: common_pb2.WeightChunk, source: memoryview) -> None:
        """A chunk whose payload the pusher wrote to shared memory: copied out
        first and the copy verified, so a pusher that rewrites its segment
        meanwhile cannot change what was checked."""
        self._accepting(chunk)
        landing = self.storage.landing(len(source))
        landing[:] = source
        seq = self.verifier.check(chunk, landing)
        self.storage.put(seq, b"", chunk, landing, landed=True)
        self._changed.fire()

    def _accepting(self, chunk: common_pb2.WeightChunk) -> None:
        if self.phase is not Phase.STAGING:
            raise Aborted(f"version {self.version} is {self.phase.value}; no more chunks are accepted")
        if chunk.zstd:
            raise InvalidArgument(f"chunk {chunk.sequence}: a push carries payloads as they are, not compressed")

    def commit(self) -> None:
        self.verifier.finish()
        self.phase = Phase.COMMITTED
        self.committed_unix_ms = int(time.time() * 1000)
        self._changed.fire()

    def abort(self, error: FlywheelError) -> None:
        if self.phase is not Phase.STAGING:
            return
        self.phase, self.error = Phase.ABORTED, error
        self._changed.fire()
        self.retire()

    def retire(self) -> None:
        """Frees the storage now, or when the last reader leaves."""
        self._retired = True
        if self.readers == 0:
            self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        segment = self.storage.segment
        self.storage.release()
        if segment is not None and self._pool is not None:
            self._pool.release(segment)

    def resume_point(self, resume_from: int, resume_digest: bytes) -> int:
        """The first chunk to send a reader resuming an interrupted pull of this stream (0: none)."""
        if not resume_from and not resume_digest:
            return 0
        if resume_digest != bytes(self.manifest.digest):
            raise FailedPrecondition(
                f"cannot resume: version {self.version} is now sent as a stream with another digest "
                "(re-encoded, or a delta from another base); pull it again from the start")
        if resume_from > self.verifier.count:
            raise InvalidArgument(f"resume_from {resume_from} is past the stream's {self.verifier.count} chunks")
        return resume_from

    async def wait_committed(self) -> None:
        """Returns once the version is committed; ABORTED if its push fails."""
        while self.phase is Phase.STAGING:
            await self._changed.wait()
        if self.phase is Phase.ABORTED:
            raise self._failure()

    def _failure(self) -> Aborted:
        return Aborted(f"the push of version {self.version} was aborted: {self.error}")

    async def stream(self, shared: bool = False, hold_seconds: float = 60.0, first_seq: int = 0,
                     compress: bool = False) -> AsyncIterator[bytes]:
        """The manifest frame, then every chunk frame from `first_seq` on (a
        resumed pull) in sequence order, as they arrive; ends only once the
        version is committed. `compress` (not with `shared`): each chunk's
        payload as a zstd frame (`flywheel.transfer.compression`), compressed
        on a worker thread.

        shared (a reader on this host, and the version is in a segment): the
        segment frame, headers-only chunk frames, then COMMITTED_FRAME; the
        stream then stays open, keeping the segment from reuse, until the
        reader hangs up (it has copied every payload) or `hold_seconds` pass.
        """
        if self._retired:
            raise self._failure() if self.phase is Phase.ABORTED else Aborted(f"version {self.version} was evicted")
        self.readers += 1
        try:
            storage = self.storage
            shared = shared and isinstance(storage, SegmentFrames)
            yield self.manifest_frame
            if isinstance(storage, SegmentFrames) and shared:
                yield storage.segment_frame()
            for seq in range(first_seq, self.verifier.count):
                while not storage.has(seq):
                    if self.phase is Phase.ABORTED:
                        raise self._failure()
                    await self._changed.wait()
                if self.phase is Phase.ABORTED:
                    raise self._failure()
                if isinstance(storage, SegmentFrames) and shared:
                    yield storage.shared_frame(seq)
                elif compress:
                    yield await asyncio.to_thread(compressed_frame, storage.frame(seq))
                else:
                    yield storage.frame(seq)
            while self.phase is Phase.STAGING:
                await self._changed.wait()
            if self.phase is Phase.ABORTED:
                raise self._failure()
            if shared:
                yield COMMITTED_FRAME
                await asyncio.sleep(hold_seconds)  # cancelled when the reader hangs up
        finally:
            self.readers -= 1
            if self._retired and self.readers == 0:
                self._release()


class WeightStore:
    """The newest `keep` committed versions plus pushes in progress (and, as delta bases only,
    older versions replicas still serve)."""

    def __init__(self, keep: int, max_staging: int = 2, pool: SegmentPool | None = None) -> None:
        self.keep = keep
        self.max_staging = max_staging
        self.pool = pool
        self.committed: dict[int, VersionBuffer] = {}  # ascending versions
        #: Versions past `keep` that replicas still serve: kept only as the bases of deltas (never
        #: pulled themselves, never a rewind's target).
        self.bases: dict[int, VersionBuffer] = {}
        self.staging: dict[int, VersionBuffer] = {}
        #: Readers waiting for a version's push to begin: (version, at_least, future).
        self._waiters: list[tuple[int, bool, asyncio.Future]] = []

    @property
    def held_bytes(self) -> int:
        held = sum(b.held_bytes for b in (*self.committed.values(), *self.bases.values(), *self.staging.values()))
        return held + (self.pool.free_bytes if self.pool is not None else 0)

    @property
    def newest(self) -> int:
        return max(self.committed, default=0)

    @property
    def oldest(self) -> int:
        return min(self.committed, default=0)

    def begin(self, manifest: common_pb2.WeightManifest, manifest_frame: bytes) -> VersionBuffer:
        if manifest.version in self.staging:
            raise AlreadyExists(f"a push of version {manifest.version} is already in progress")
        if len(self.staging) >= self.max_staging:
            raise ResourceExhausted(
                f"{len(self.staging)} pushes (versions {sorted(self.staging)}) are in progress; retry when one ends"
            )
        buffer = VersionBuffer(manifest, manifest_frame, self.pool)
        self.staging[buffer.version] = buffer
        self._offer(buffer)
        return buffer

    def _offer(self, buffer: VersionBuffer) -> None:
        # Waiters get the buffer itself, not a wake-up to look for it: a push
        # that fails before they run still reaches them (as ABORTED).
        for entry in list(self._waiters):
            version, at_least, future = entry
            if buffer.version == version or (at_least and buffer.version >= version):
                self._waiters.remove(entry)
                if not future.done():
                    future.set_result(buffer)

    def commit(self, buffer: VersionBuffer, leased: dict[int, bytes] | None = None, lease_bytes: int = 0) -> list[int]:
        """Verifies and commits a staging version; returns the evicted versions.

        Past the newest `keep`, a version stays in `bases` while it is `leased` (version ->
        identity of the weights a live replica serves: the base its next delta is made from),
        newest first, as long as the versions kept that way hold at most `lease_bytes`."""
        buffer.commit()  # raises (and the caller aborts) on a truncated or tampered version
        self.staging.pop(buffer.version, None)
        self.committed[buffer.version] = buffer
        self.committed = dict(sorted(self.committed.items()))
        evicted = list(self.committed)[: -self.keep]
        candidates = {**self.bases, **{v: self.committed.pop(v) for v in evicted}}
        self.bases, budget = {}, lease_bytes
        for version in sorted(candidates, reverse=True):
            old = candidates[version]
            if (leased or {}).get(version) == bytes(old.manifest.identity) and old.held_bytes <= budget:
                budget -= old.held_bytes
                self.bases[version] = old
            else:
                old.retire()
        self.bases = dict(sorted(self.bases.items()))
        for version in [v for v in self.staging if v < buffer.version]:
            self.abort(self.staging[version], Aborted(f"superseded by version {buffer.version}"))
        return evicted

    def drop_above(self, version: int) -> None:
        """A rewind: every committed version above `version` leaves (readers already streaming
        one finish), every push of one is aborted."""
        for v in [v for v in self.staging if v > version]:
            self.abort(self.staging[v], Aborted(f"the weights were rewound to version {version}"))
        for v in [v for v in self.committed if v > version]:
            self.committed.pop(v).retire()
        for v in [v for v in self.bases if v > version]:
            self.bases.pop(v).retire()

    def abort(self, buffer: VersionBuffer, error: FlywheelError) -> None:
        buffer.abort(error)
        if self.staging.get(buffer.version) is buffer:
            del self.staging[buffer.version]

    def find(self, version: int, at_least: bool = False) -> VersionBuffer | None:
        """The buffer of `version`; with at_least, the newest committed one
        >= version, else the oldest push of one in progress."""
        if not at_least:
            return self.committed.get(version) or self.staging.get(version)
        if self.newest >= version:
            return self.committed[self.newest]
        return next((self.staging[v] for v in sorted(self.staging) if v >= version), None)

    async def wait_for(self, version: int, timeout: float, at_least: bool = False) -> VersionBuffer | None:
        """The buffer of `version` once its push begins (or None after `timeout` seconds)."""
        found = self.find(version, at_least)
        if found is not None:
            return found
        entry = (version, at_least, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(entry[2], timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def close(self) -> None:
        """Removes every shared segment (at shutdown: readers' maps stay valid)."""
        if self.pool is not None:
            self.pool.close()

    def evicted_error(self, version: int) -> NotFound:
        if not self.committed:
            return NotFound(f"version {version} is no longer held in memory, and no version is")
        return NotFound(
            f"version {version} is no longer held in memory; the oldest kept is {self.oldest} "
            f"(kept: {list(self.committed)})"
        )
