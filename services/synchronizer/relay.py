"""A synchronizer in relay mode: a far site's cache of the run's versions.

A site across a slow link (another region, another cluster) runs one relay
beside its replicas. The relay fetches each version once over the slow link
from its upstream synchronizer and serves it to the site's replicas, which
find it in the upstream's registry (a SYNCHRONIZER component whose `site`
label is theirs) and pull from it instead of the upstream. The replicas
still register, heartbeat and report to the upstream, which keeps owning the
run's versions and policy: the relay only holds bytes.

How a version crosses the slow link:
- the relay holds a version already: it asks for the new one as a delta from
  it (`flywheel.codec.delta`), rebuilds it, verified against its identity,
  and commits the full version locally;
- it holds none (its first version): the full version streams through, cut
  through: each chunk, checked, is passed on to the site's readers as it
  arrives, so the last replica is ready soon after the first;
- a broken stream resumes from the first chunk not received
  (`flywheel.synchronizer.pull`).
Readers that ask for the same version share one fetch; the site's replicas
can in turn be sent deltas from what they hold (`services.synchronizer.deltas`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from flywheel.codec import encode_state_dict
from flywheel.codec.identity import manifest_identity
from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import Aborted, DataLoss, FlywheelError, Unavailable
from flywheel.runtime.client import domain_error
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import DeltaBase
from flywheel.synchronizer.pull import MAX_RESUMES, resume_delay
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import CHUNK_FIELD, MANIFEST_FIELD, encoded_frames, split_frame
from services.synchronizer.buffers import VersionBuffer, WeightStore
from services.synchronizer.deltas import decode

log = logging.getLogger(__name__)


class Relay:
    def __init__(self, upstream: str, connect: Callable[[], SynchronizerClient], weights: WeightStore,
                 timeout: float) -> None:
        self.upstream = upstream
        self._connect = connect
        self._client: SynchronizerClient | None = None
        self.weights = weights
        self.timeout = timeout
        #: Version -> the fetch in flight (resolves to its buffer as soon as the buffer exists).
        self._fetching: dict[int, asyncio.Future[VersionBuffer]] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def client(self) -> SynchronizerClient:
        """The upstream's client, made on first use: inside the server's event loop, which its channel needs."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    async def open(self, version: int, wait_seconds: float, at_least: bool) -> VersionBuffer:
        """The buffer of `version` (0: the upstream's newest; with at_least, the newest >= it), fetched
        from upstream unless held or being fetched."""
        if at_least or version == 0:
            version = await self._resolve(version, wait_seconds)
        held = self.weights.find(version)
        if held is not None:
            return held
        future = self._fetching.get(version)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._fetching[version] = future
            task = asyncio.ensure_future(self._fetch(version, wait_seconds, future))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(future)

    async def _resolve(self, version: int, wait_seconds: float) -> int:
        """The version an at-least (or newest) request means upstream now."""
        status = await self.client.status()
        if status.latest_version >= max(version, 1):
            return status.latest_version
        if version == 0:
            raise Unavailable("the upstream synchronizer has committed no version yet")
        if wait_seconds <= 0:
            raise Unavailable(f"the upstream's newest version is {status.latest_version}, not >= {version}")
        return version  # not committed upstream yet: fetch it cut-through when its push begins

    async def _fetch(self, version: int, wait_seconds: float, future: asyncio.Future[VersionBuffer]) -> None:
        try:
            base = max((v for v in self.weights.committed if v < version), default=0)
            if base:
                await self._fetch_delta(version, self.weights.committed[base], future)
            else:
                await self._fetch_through(version, wait_seconds, future)
        except BaseException as exc:  # noqa: BLE001 - the readers waiting on the future are told
            if isinstance(exc, grpc.aio.AioRpcError):
                exc = domain_error(exc, f"relay's upstream PullWeights from {self.client.address}")
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else Aborted(f"fetch of version {version} stopped"))
                future.exception()  # retrieved here; each reader re-raises it
            if not isinstance(exc, Exception):
                raise
        finally:
            self._fetching.pop(version, None)

    async def _fetch_delta(self, version: int, base: VersionBuffer, future: asyncio.Future[VersionBuffer]) -> None:
        """Pulls `version` as a delta from a held version, rebuilds and commits it in full."""
        identity = manifest_identity(base.manifest)
        held = await asyncio.to_thread(decode, base)
        offered = DeltaBase(base.version, identity, held) if identity is not None else None
        pulled = await self.client.pull_weights(version, base=offered, timeout=self.timeout)
        log.info("relay fetched a version", extra={"version": version, "from_base": pulled.stats.delta_base,
                                                    "wire_bytes": pulled.stats.stream_bytes})
        encoded = await asyncio.to_thread(
            encode_state_dict, pulled.tensors, version, chunk_bytes=max(1, base.manifest.chunk_bytes))
        if pulled.identity is not None and encoded.manifest.identity != pulled.identity.digest:
            raise DataLoss(f"version {version} re-encoded here is not the version pulled")
        frames = encoded_frames(encoded)
        buffer = self.weights.begin(encoded.manifest, next(frames))
        future.set_result(buffer)
        try:
            for frame in frames:
                buffer.add(frame, *parse_chunk(split_frame(frame)[1]))
            self.weights.commit(buffer)
        except BaseException as exc:
            self.weights.abort(buffer, exc if isinstance(exc, FlywheelError) else Aborted(str(exc)))
            raise

    async def _fetch_through(self, version: int, wait_seconds: float, future: asyncio.Future[VersionBuffer]) -> None:
        """Streams the full version from upstream into a buffer that local readers read as it fills."""
        request = pb.PullWeightsRequest(version=version, wait_seconds=wait_seconds)
        buffer: VersionBuffer | None = None
        received, resumes = 0, 0
        try:
            while True:
                call = self.client.pull_frames(request, timeout=self.timeout + wait_seconds)
                try:
                    async for frame in call:
                        field, payload = split_frame(frame)
                        if field == MANIFEST_FIELD:
                            manifest = cpb.WeightManifest.FromString(bytes(payload))
                            if buffer is None:
                                buffer = self.weights.begin(manifest, frame)
                                future.set_result(buffer)
                            elif manifest.digest != buffer.manifest.digest:
                                raise Aborted(f"the resumed upstream stream of version {version} is another stream")
                        elif field == CHUNK_FIELD and buffer is not None:
                            buffer.add(frame, *parse_chunk(payload))
                            received += 1
                        else:
                            raise Aborted("the upstream's pull stream did not start with a manifest")
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or buffer is None or resumes >= MAX_RESUMES:
                        raise
                    resumes += 1
                    await asyncio.sleep(resume_delay(resumes))
                    log.info("relay's upstream stream broke; resuming", extra={"version": version, "from_chunk": received})
                    request = pb.PullWeightsRequest(version=version, resume_from=received,
                                                    resume_digest=buffer.manifest.digest)
                finally:
                    call.cancel()
            if buffer is None:
                raise Aborted(f"the upstream's stream of version {version} ended before its manifest")
            self.weights.commit(buffer)
            log.info("relay fetched a version", extra={"version": version, "from_base": 0,
                                                        "wire_bytes": buffer.payload_bytes, "resumes": resumes})
        except BaseException as exc:
            if buffer is not None:
                self.weights.abort(buffer, exc if isinstance(exc, FlywheelError) else Aborted(str(exc)))
            raise

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            await self._client.close()
