"""The weight plane of the synchronizer: MEMORY pushes and pulls, CHECKPOINT
registrations, NCCL group allocation and outcome queries, and the status.

Versions are transactions: a push is staged, verified and only then
committed (a failure of any kind leaves no trace and the previous newest
version is still served); a checkpoint is announced only after its directory
checks out; an NCCL version counts only once every receiver confirmed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flywheel.codec.identity import VersionIdentity
from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FailedPrecondition, FlywheelError, InvalidArgument, NotFound, Unavailable
from flywheel.probe import ProbeBatch
from flywheel.synchronizer.client_types import VersionProof
from flywheel.synchronizer.convert import probe_from_pb
from flywheel.runtime.paths import confine
from flywheel.transfer.segments import PREFIX as SEGMENT_PREFIX
from flywheel.transfer.segments import PUSH_SEGMENT_REFUSED, SegmentMaps, SegmentUnavailable
from services.synchronizer import metrics
from services.synchronizer.buffers import VersionBuffer
from services.synchronizer.checkpoints import checkpoint_proof, verify_checkpoint
from services.synchronizer.core import Synchronizer
from services.synchronizer.deltas import DeltaCache
from services.synchronizer.relay import Relay
from services.synchronizer.groups import Group
from flywheel.synchronizer.types import Component, EventKind, Method, Policy, Role, State
from services.synchronizer.versions import VersionRecord, checked_digests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionStatus:
    record: VersionRecord
    in_memory: bool


@dataclass(frozen=True)
class Status:
    components: list[Component]
    versions: list[VersionStatus]
    latest_version: int
    policy: Policy
    transfers: list[Group]
    held_bytes: int


class WeightPlane:
    def __init__(self, sync: Synchronizer) -> None:
        self.sync = sync
        self.weights = sync.weights
        self.deltas = DeltaCache(sync.config.delta_cache_bytes)
        #: Pushers' segments, kept mapped from push to push (a fresh map faults in every page).
        self.push_maps = SegmentMaps(max_open=2)
        #: Set in relay mode: versions come from the upstream synchronizer, not from pushes.
        self.relay: Relay | None = None

    # -- MEMORY: push --------------------------------------------------------

    def _not_a_relay(self, what: str) -> None:
        if self.relay is not None:
            raise FailedPrecondition(f"this synchronizer is a relay of {self.relay.upstream}: {what} goes there")

    def begin_push(self, manifest: common_pb2.WeightManifest, frame: bytes) -> VersionBuffer:
        self._not_a_relay("a push")
        # A version equal to the newest is accepted only to restore bytes lost in a restart.
        self.sync.check_version(manifest.version, "push", allow_equal=self.sync.push_requested)
        pushed_proof(manifest)  # refused before anything is staged
        buffer = self.weights.begin(manifest, frame)
        self.sync.events.publish(EventKind.VERSION_STAGED, version=buffer.version, method=Method.MEMORY)
        metrics.WEIGHTS_HELD_BYTES.set(self.weights.held_bytes)
        return buffer

    def add_chunk(self, buffer: VersionBuffer, frame: bytes, chunk: common_pb2.WeightChunk, data: memoryview) -> None:
        buffer.add(frame, chunk, data)
        metrics.WEIGHT_PUSH_BYTES.inc(len(data))

    def map_push_segment(self, manifest: common_pb2.WeightManifest, path: str, nonce: bytes, size: int,
                         header_bytes: int) -> memoryview:
        """The payload region of a pusher's shared-memory segment (flywheel.synchronizer.push).

        Only a flywheel segment in this synchronizer's shared_memory_dir is
        mapped (never any other file a caller names); anything else, or a
        segment this host does not have, is refused before the push stages
        anything, and the pusher sends the payloads in the stream instead."""
        self._not_a_relay("a push")
        directory = self.sync.config.shared_memory_dir
        candidate = Path(path)
        try:
            if not directory or candidate.parent != Path(directory) or not candidate.name.startswith(SEGMENT_PREFIX):
                raise SegmentUnavailable(f"{path} is not a weight segment in this synchronizer's shared_memory_dir "
                                         f"({directory or 'off'})")
            if size < manifest.total_bytes:
                raise SegmentUnavailable(f"segment of {size} bytes for a version of {manifest.total_bytes}")
            return self.push_maps.open(path, nonce, size, header_bytes)
        except SegmentUnavailable as exc:
            raise FailedPrecondition(f"{PUSH_SEGMENT_REFUSED}: {exc}") from None

    def add_shared_chunk(self, buffer: VersionBuffer, chunk: common_pb2.WeightChunk, segment: memoryview,
                         offset: int, length: int) -> None:
        if offset + length > len(segment):
            raise InvalidArgument(f"chunk {chunk.sequence}: bytes [{offset}, {offset + length}) lie outside the "
                                  f"pusher's {len(segment)}-byte segment")
        buffer.add_copied(chunk, segment[offset : offset + length])
        metrics.WEIGHT_PUSH_BYTES.inc(length)
        metrics.WEIGHT_PUSH_SHARED_BYTES.inc(length)

    def commit_push(self, buffer: VersionBuffer) -> list[int]:
        """Verifies completeness and digest, then commits; returns the kept versions."""
        self.sync.check_version(buffer.version, "push", allow_equal=self.sync.push_requested)
        evicted = self.weights.commit(buffer, self._leased(), self.sync.config.delta_base_bytes)
        tensors, probe = pushed_proof(buffer.manifest)
        record = VersionRecord(buffer.version, Method.MEMORY, buffer.payload_bytes,
                               identity=bytes(buffer.manifest.identity), tensors=tensors, probe=probe)
        self.sync.commit_version(record)
        metrics.WEIGHT_SYNC_DURATION.labels("memory").observe(time.monotonic() - buffer.started)
        log.info(
            "version committed", extra={"version": buffer.version, "bytes": buffer.payload_bytes, "evicted": evicted}
        )
        return list(self.weights.committed)

    def _leased(self) -> dict[int, bytes]:
        """Version -> identity of the weights live replicas serve: the bases of their next deltas."""
        return {c.weight_version: c.weight_identity for c in self.sync.registry.components.values()
                if c.role is Role.ROLLOUT and c.state is not State.STOPPED and c.weight_identity}

    def abort_push(self, buffer: VersionBuffer, error: BaseException) -> None:
        reason = error if isinstance(error, FlywheelError) else FailedPrecondition(f"push ended: {error!r}")
        self.weights.abort(buffer, reason)
        metrics.WEIGHT_SYNC_FAILURES.labels("memory").inc()
        metrics.WEIGHTS_HELD_BYTES.set(self.weights.held_bytes)
        log.warning("push aborted", extra={"version": buffer.version, "reason": str(error) or type(error).__name__})

    # -- MEMORY: pull --------------------------------------------------------

    async def open_pull(self, version: int, wait_seconds: float = 0.0, at_least: bool = False,
                        base_version: int = 0, base_identity: bytes = b"") -> VersionBuffer:
        """The buffer to stream for `version` (0: the newest committed; with
        at_least, the newest >= version, waiting for a push of one to begin);
        with `base_version`, as a delta from it when one applies
        (`services.synchronizer.deltas`)."""
        if self.relay is not None:
            buffer = await self.relay.open(version, wait_seconds, at_least)
        else:
            buffer = await self._find_pull(version, wait_seconds, at_least)
        if not base_version:
            return buffer
        base = self.weights.committed.get(base_version) or self.weights.bases.get(base_version)
        return await self.deltas.answer(buffer, base, base_version, base_identity)

    async def _find_pull(self, version: int, wait_seconds: float, at_least: bool) -> VersionBuffer:
        catalog = self.sync.catalog
        if at_least and version > 0:
            if version <= catalog.latest:
                version = 0  # the newest committed qualifies
            else:
                buffer = await self.weights.wait_for(version, wait_seconds, at_least=True)
                if buffer is None:
                    raise NotFound(f"no version >= {version} has been pushed (newest committed: {catalog.latest})")
                return buffer
        if version == 0:
            record = catalog.latest_record()
            if record is None:
                raise NotFound("no weight version has been committed yet")
            version = record.version
        buffer = self.weights.find(version)
        if buffer is not None:
            return buffer
        record = catalog.get(version)
        if record is not None and record.method != Method.MEMORY:
            where = f" at {record.path}" if record.path else ""
            raise FailedPrecondition(f"version {version} was published by {record.method.name}{where}, not MEMORY")
        if record is not None and version == catalog.latest:
            raise Unavailable(
                f"the bytes of version {version} were lost when the synchronizer restarted; "
                "the trainer has been asked to push it again"
            )
        if version <= catalog.latest:
            raise self.weights.evicted_error(version)
        buffer = await self.weights.wait_for(version, wait_seconds) if wait_seconds > 0 else None
        if buffer is None:
            raise NotFound(f"version {version} has not been pushed (newest committed: {catalog.latest})")
        return buffer

    # -- CHECKPOINT ----------------------------------------------------------

    async def register_checkpoint(self, version: int, path: str, trainer_id: str,
                                  tensors: dict[str, bytes] | None = None, probe: ProbeBatch | None = None) -> int:
        """Commits a checkpoint directory once it checks out. Its identity is the one its
        `weight_manifest.pb` records; the registration's `tensors` (each tensor's digest) and
        `probe` must agree with the manifest's where it has them (DATA_LOSS otherwise: the
        directory is not what the trainer says it wrote) and are recorded with the version."""
        self._not_a_relay("a checkpoint registration")
        if not path:
            raise InvalidArgument("path: empty")
        root = self.sync.config.checkpoint_root
        path = str(confine(path, [root] if root else [], "path"))
        existing = self.sync.catalog.get(version) if version else None
        if existing is not None and existing.method == Method.CHECKPOINT and existing.path == path:
            return version  # a retried registration
        self.sync.check_version(version, "checkpoint")
        started = time.monotonic()
        try:
            nbytes = await asyncio.to_thread(
                verify_checkpoint, path, version,
                require_manifest=self.sync.config.checkpoint_require_manifest,
                verify_digest=self.sync.config.checkpoint_verify_digest,
            )
            identity, tensors, probe = _checkpoint_record(path, *await asyncio.to_thread(checkpoint_proof, path),
                                                          tensors or {}, probe)
            self.sync.check_version(version, "checkpoint")  # something newer may have landed meanwhile
        except FlywheelError:
            metrics.WEIGHT_SYNC_FAILURES.labels("checkpoint").inc()
            raise
        self.sync.commit_version(VersionRecord(version, Method.CHECKPOINT, nbytes, path, identity=identity,
                                               tensors=tensors, probe=probe))
        metrics.WEIGHT_SYNC_DURATION.labels("checkpoint").observe(time.monotonic() - started)
        log.info("checkpoint registered", extra={"version": version, "path": path, "trainer_id": trainer_id})
        return version

    def get_checkpoint(self, version: int) -> VersionRecord:
        if version == 0:
            record = self.sync.catalog.newest_of(Method.CHECKPOINT)
            if record is None:
                raise NotFound("no checkpoint version has been registered")
            return record
        record = self.sync.catalog.get(version)
        if record is None or record.method != Method.CHECKPOINT:
            raise NotFound(f"version {version} is not a registered checkpoint")
        return record

    # -- NCCL ----------------------------------------------------------------

    def _member(self, component_id: str, role: Role) -> Component:
        c = self.sync.registry.get(component_id)
        if c.role != role:
            raise InvalidArgument(f"{component_id!r} is a {c.role.name.lower()}, not a {role.name.lower()}")
        if c.state == State.STOPPED:
            raise FailedPrecondition(f"{role.name.lower()} {component_id!r} is STOPPED")
        return c

    def allocate_group(
        self, version: int, trainer_id: str, rollout_ids: Sequence[str], timeout: float, backend: str
    ) -> Group:
        self._not_a_relay("an NCCL group")
        trainer = self._member(trainer_id, Role.TRAINER)
        self.sync.check_version(version, "transfer", allow_equal=True)  # equal: catching up a replica
        if rollout_ids:
            rollouts = [self._member(rid, Role.ROLLOUT) for rid in dict.fromkeys(rollout_ids)]
        else:
            # Those behind it: every one for a new version, the late ones when it is broadcast again;
            # and those a rewind sent back, whatever their number (they serve a lost lineage's weights).
            rewinding = self.sync.registry.rewinding
            rollouts = [
                r for r in self.sync.registry.live(Role.ROLLOUT)
                if (not r.identity.capabilities or Method.NCCL in r.identity.capabilities)
                and (r.weight_version < version or r.id in rewinding)
            ]
        group = self.sync.transfers.allocate(version, trainer, rollouts, timeout, backend)
        self.sync.events.publish(
            EventKind.TRANSFER_STARTED, version=version, method=Method.NCCL, location=group.group_id, group=group
        )
        log.info(
            "group allocated", extra={"group_id": group.group_id, "members": group.members, "backend": group.backend}
        )
        return group

    def report_transfer(self, group_id: str, component_id: str, success: bool, error: str,
                        identity: bytes = b"", tensors: dict[str, bytes] | None = None,
                        probe: ProbeBatch | None = None) -> Group:
        """`identity`, `tensors` and `probe`: rank 0's report of what it sent (recorded with the
        version once the transfer commits); the tensor digests must compose to the identity."""
        if tensors or probe is not None:
            group = self.sync.transfers.get(group_id)
            if component_id != group.trainer_id or not success:
                raise InvalidArgument(f"only rank 0 ({group.trainer_id!r}), reporting success, sends the version's "
                                      f"tensor digests and probe; {component_id!r} sent them")
        tensors = checked_digests(identity, tensors or {}, "tensors")
        return self.sync.transfers.report(group_id, component_id, success, error, identity, tensors, probe)

    async def get_transfer(self, group_id: str, wait_seconds: float) -> Group:
        return await self.sync.transfers.wait(group_id, wait_seconds)

    # -- what a version is ----------------------------------------------------

    async def get_version(self, version: int) -> VersionProof:
        """What `version` was committed with (GetVersion). A relay holds bytes, not the run's
        catalog: it asks its upstream (within its client's deadline)."""
        if self.relay is not None:
            return await self.relay.client.get_version(version)
        r = self.sync.version_record(version)
        return VersionProof(r.version, VersionIdentity(r.identity, dict(r.tensors)), r.probe, r.epoch)

    # -- status --------------------------------------------------------------

    def status(self) -> Status:
        s = self.sync
        return Status(
            components=sorted(s.registry.components.values(), key=lambda c: (c.role, c.id)),
            versions=[VersionStatus(r, self.weights.find(r.version) is not None) for r in s.catalog.ordered()],
            latest_version=s.catalog.latest,
            policy=s.policy,
            transfers=list(s.transfers.groups.values()),
            held_bytes=self.weights.held_bytes,
        )


def pushed_proof(manifest: common_pb2.WeightManifest) -> tuple[dict[str, bytes], ProbeBatch | None]:
    """What a pushed manifest says the version is beyond its identity: every tensor's digest (recorded
    only when each tensor has one: the codec checked they compose to the identity) and the trainer's
    probe; INVALID_ARGUMENT for a malformed probe."""
    tensors = {t.name: bytes(t.digest) for t in manifest.tensors}
    whole = bool(tensors) and all(tensors.values())
    tensors = checked_digests(bytes(manifest.identity), tensors if whole else {}, "manifest.tensors")
    return tensors, probe_from_pb(manifest.probe, "manifest.probe")


def _checkpoint_record(
    path: str, identity: bytes, listed: dict[str, bytes], written: ProbeBatch | None,
    tensors: dict[str, bytes], probe: ProbeBatch | None,
) -> tuple[bytes, dict[str, bytes], ProbeBatch | None]:
    """(identity, tensor digests, probe) of a checkpoint: its manifest's (`identity`, `listed`,
    `written`), which the registration's `tensors` and `probe` must agree with."""
    if tensors and not identity:
        raise InvalidArgument(f"tensors: {path} has no weight_manifest.pb with the identity the tensor digests "
                              "compose to; write one, or register without tensor digests")
    if tensors and listed and tensors != listed:
        differ = sorted(n for n in set(tensors) | set(listed) if tensors.get(n) != listed.get(n))
        raise DataLoss(f"{path}: weight_manifest.pb and the registration disagree on {len(differ)} tensor digest(s) "
                       f"({', '.join(differ[:3])}): the directory is not what the trainer says it wrote")
    if probe is not None and written is not None and probe != written:
        raise DataLoss(f"{path}: weight_manifest.pb holds another probe than the registration sends")
    return identity, checked_digests(identity, tensors or listed, "tensors"), probe or written
