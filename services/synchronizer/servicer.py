"""gRPC servicer of the synchronizer: translates protobuf to the domain.

PushWeights and PullWeights work on raw frames (see `app.register`, which
installs them with identity (de)serializers): a push hands each message's
bytes to the weight store after verifying it, and a pull writes the stored
bytes back unchanged, so a chunk is never re-serialized per reader (a
reader on the synchronizer's host may instead read payloads in place from
shared memory: `shared_memory` in the request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from google.protobuf.message import DecodeError

from flywheel.codec.wire import parse_chunk
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import DataLoss, DeadlineExceeded, InvalidArgument
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc
from flywheel.transfer.frames import CHUNK_FIELD, MANIFEST_FIELD, SEGMENT_FIELD, SHARED_CHUNK_FIELD, frame_field, split_frame
from services.synchronizer import metrics
from services.synchronizer.buffers import COMMITTED_FRAME
from flywheel.synchronizer.convert import (
    component_to_pb,
    group_to_pb,
    identity_bytes,
    identity_from_pb,
    policy_from_pb,
    policy_to_pb,
    probe_from_pb,
    state_from_pb,
    tensor_digests_from_pb,
    update_report_from_pb,
    update_to_pb,
)
from services.synchronizer.core import Synchronizer
from services.synchronizer.events import Event
from services.synchronizer.groups import Group
from services.synchronizer.plane import WeightPlane
from flywheel.synchronizer.types import Component, Role


def event_to_pb(e: Event) -> pb.WatchResponse:
    msg = pb.WatchResponse(
        kind=int(e.kind), latest_version=e.latest_version, location=e.location, sequence=e.sequence,
        unix_ms=e.unix_ms, version=e.version, message=e.message, epoch=e.epoch, rewound_to=e.rewound_to,
        identity=e.identity,
    )
    if e.update is not None:
        msg.update.CopyFrom(update_to_pb(e.update))
    if e.component is not None:
        msg.component.CopyFrom(component_to_pb(e.component))
    if e.method is not None:
        msg.method = int(e.method)
    if e.group is not None:
        msg.group.CopyFrom(group_to_pb(e.group))
    if e.transfer_state is not None:
        msg.transfer_state = int(e.transfer_state)
    return msg


def transfer_to_pb(group: Group) -> pb.GetTransferResponse:
    return pb.GetTransferResponse(
        state=int(group.state), error=group.error, group=group_to_pb(group), confirmed=sorted(group.confirmed),
        identity=group.identity,
    )


async def _next_frame(frames: AsyncIterator[bytes], idle_seconds: float) -> bytes | None:
    try:
        if hasattr(asyncio, "timeout"):  # 3.11+: no task per message, unlike wait_for
            async with asyncio.timeout(idle_seconds):
                return await anext(frames, None)
        return await asyncio.wait_for(anext(frames, None), idle_seconds)
    except (TimeoutError, asyncio.TimeoutError):
        raise DeadlineExceeded(f"the push sent nothing for {idle_seconds:g}s; aborted") from None


def _push_message(frame: bytes) -> pb.PushWeightsRequest:
    """A small push message (a segment, a shared chunk's header) parsed whole."""
    try:
        return pb.PushWeightsRequest.FromString(frame)
    except DecodeError as exc:
        raise InvalidArgument(f"unreadable push message: {exc}") from None


class SynchronizerServicer(pb_grpc.SynchronizerServiceServicer):
    def __init__(self, sync: Synchronizer, plane: WeightPlane) -> None:
        self.sync = sync
        self.plane = plane

    # -- components ----------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        c = self.sync.register(identity_from_pb(request.identity), request.step, request.weight_version,
                               identity_bytes(request.weight_identity, "weight_identity"))
        return pb.RegisterResponse(
            lease_seconds=self.sync.config.lease_seconds, state=int(c.state),
            latest_version=self.sync.catalog.latest, push_requested=self._push_requested(c),
        )

    def _push_requested(self, c: Component) -> bool:
        return c.role == Role.TRAINER and self.sync.push_requested

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        c = self.sync.heartbeat(request.id, request.step, request.weight_version)
        return pb.HeartbeatResponse(
            state=int(c.state), latest_version=self.sync.catalog.latest, push_requested=self._push_requested(c)
        )

    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        self.sync.deregister(request.id)
        return pb.DeregisterResponse()

    async def SetState(self, request: pb.SetStateRequest, context) -> pb.SetStateResponse:
        c = self.sync.set_state(
            request.id, state_from_pb(request.state, "state"),
            expected=state_from_pb(request.expected_state, "expected_state", optional=True),
            weight_version=request.weight_version, reason=request.reason,
            weight_identity=identity_bytes(request.weight_identity, "weight_identity"),
        )
        return pb.SetStateResponse(state=int(c.state))

    async def Watch(self, request: pb.WatchRequest, context) -> AsyncIterator[pb.WatchResponse]:
        events = self.sync.events
        sub = events.subscribe(request.ids)
        metrics.WATCHERS.set(events.subscriber_count)
        # The stream ends cleanly (OK) just before the caller's deadline, so
        # a watcher sees "watch again", not an error, when its time is up.
        remaining = context.time_remaining()
        end = None if remaining is None else time.monotonic() + remaining - min(0.5, remaining / 10)
        try:
            if request.send_initial:
                components = list(self.sync.registry.components.values())
                for event in events.snapshot_events(components, frozenset(request.ids)):
                    yield event_to_pb(event)
            while True:
                if end is None:
                    event = await sub.get()
                else:
                    try:
                        event = await asyncio.wait_for(sub.get(), max(0.0, end - time.monotonic()))
                    except asyncio.TimeoutError:
                        return
                if event is None:  # the synchronizer stops: the stream ends cleanly, and the watcher watches again
                    return
                yield event_to_pb(event)
        finally:
            events.unsubscribe(sub)
            metrics.WATCHERS.set(events.subscriber_count)

    # -- policy --------------------------------------------------------------

    async def ConfigurePolicy(self, request: pb.ConfigurePolicyRequest, context) -> pb.ConfigurePolicyResponse:
        self.sync.configure_policy(**policy_from_pb(request))
        return pb.ConfigurePolicyResponse()

    async def NeedSync(self, request: pb.NeedSyncRequest, context) -> pb.NeedSyncResponse:
        answer = self.sync.need_sync(request.id, request.step)
        response = pb.NeedSyncResponse(
            need_sync=answer.decision.need_sync, version=answer.decision.version,
            state=int(answer.component.state), method=int(answer.method), latest_version=answer.latest_version,
            push_requested=answer.push_requested, request_deadline_unix_ms=answer.request_deadline_unix_ms,
            policy=policy_to_pb(answer.policy),
        )
        if answer.group is not None:
            response.group.CopyFrom(group_to_pb(answer.group))
        return response

    # -- MEMORY --------------------------------------------------------------

    async def PushWeights(self, request_iterator: AsyncIterator[bytes], context) -> pb.PushWeightsResponse:
        idle = self.sync.config.push_idle_timeout_seconds
        frames = aiter(request_iterator)
        first = await _next_frame(frames, idle)
        try:
            field, payload = split_frame(first or b"")
        except DataLoss:
            field = 0
        if field != MANIFEST_FIELD:
            raise InvalidArgument("a push must start with a manifest message, then its chunks")
        try:
            manifest = cpb.WeightManifest.FromString(bytes(payload))
        except DecodeError as exc:
            raise InvalidArgument(f"unreadable manifest: {exc}") from None
        frame = await _next_frame(frames, idle)
        segment = None  # the pusher's shared memory, when it is on this host
        if frame is not None and frame_field(frame) == SEGMENT_FIELD:
            s = _push_message(frame).segment
            segment = self.plane.map_push_segment(manifest, s.path, s.nonce, s.size, s.header_bytes)
            frame = await _next_frame(frames, idle)
        buffer = self.plane.begin_push(manifest, first)
        try:
            while frame is not None:
                field = frame_field(frame)
                if field == CHUNK_FIELD and segment is None:
                    self.plane.add_chunk(buffer, frame, *parse_chunk(split_frame(frame)[1]))
                elif field == SHARED_CHUNK_FIELD and segment is not None:
                    shared = _push_message(frame).shared_chunk
                    self.plane.add_shared_chunk(buffer, shared.chunk, segment, shared.segment_offset, shared.length)
                else:
                    raise InvalidArgument("a push is a manifest, then its chunks (or a shared-memory segment, "
                                          "then its chunks' headers), each once")
                frame = await _next_frame(frames, idle)
            kept = self.plane.commit_push(buffer)
        except BaseException as exc:  # also cancellation: a vanished trainer leaves no trace
            self.plane.abort_push(buffer, exc)
            raise
        return pb.PushWeightsResponse(version=manifest.version, bytes=manifest.total_bytes, kept_versions=kept)

    async def PullWeights(self, request: pb.PullWeightsRequest, context) -> AsyncIterator[bytes]:
        if request.wait_seconds < 0:
            raise InvalidArgument(f"wait_seconds must be >= 0, got {request.wait_seconds}")
        if request.base_version and len(request.base_identity) != 16:
            raise InvalidArgument("base_version needs the 16-byte base_identity of the weights the reader holds")
        buffer = await self.plane.open_pull(request.version, request.wait_seconds, request.at_least,
                                            request.base_version, request.base_identity)
        first_seq = buffer.resume_point(request.resume_from, bytes(request.resume_digest))
        # A resumed pull gets its payloads in the stream: it is a far reader's.
        shared = request.shared_memory and buffer.shared and not first_seq
        # A shared-memory reader hangs up once it copied everything; this only
        # bounds how long a reader that never does keeps the segment reserved.
        remaining = context.time_remaining()
        hold = 60.0 if remaining is None else max(0.0, min(60.0, remaining - 1.0))
        # A delta's records are compressed already.
        compress = request.compress and not shared and not buffer.manifest.base_version
        async for frame in buffer.stream(shared, hold, first_seq, compress):
            if frame is COMMITTED_FRAME:  # every payload was offered in place
                metrics.WEIGHT_PULL_SHARED_BYTES.inc(buffer.payload_bytes)
            yield frame
            metrics.WEIGHT_PULL_BYTES.inc(len(frame))

    # -- CHECKPOINT ----------------------------------------------------------

    async def RegisterCheckpoint(self, request: pb.RegisterCheckpointRequest, context) -> pb.RegisterCheckpointResponse:
        version = await self.plane.register_checkpoint(
            request.version, request.path, request.trainer_id, tensor_digests_from_pb(request.tensors, "tensors"),
            probe_from_pb(request.probe, "probe"))
        return pb.RegisterCheckpointResponse(version=version)

    async def GetCheckpoint(self, request: pb.GetCheckpointRequest, context) -> pb.GetCheckpointResponse:
        record = self.plane.get_checkpoint(request.version)
        return pb.GetCheckpointResponse(version=record.version, path=record.path)

    # -- NCCL ----------------------------------------------------------------

    async def AllocateGroup(self, request: pb.AllocateGroupRequest, context) -> pb.AllocateGroupResponse:
        group = self.plane.allocate_group(
            request.version, request.trainer_id, list(request.rollout_ids), request.timeout_seconds, request.backend
        )
        return group_to_pb(group)

    async def ReportTransfer(self, request: pb.ReportTransferRequest, context) -> pb.ReportTransferResponse:
        group = self.plane.report_transfer(request.group_id, request.id, request.success, request.error,
                                           identity_bytes(request.identity, "identity"),
                                           tensor_digests_from_pb(request.tensors, "tensors"),
                                           probe_from_pb(request.probe, "probe"))
        return pb.ReportTransferResponse(state=int(group.state))

    async def GetTransfer(self, request: pb.GetTransferRequest, context) -> pb.GetTransferResponse:
        if request.wait_seconds < 0:
            raise InvalidArgument(f"wait_seconds must be >= 0, got {request.wait_seconds}")
        return transfer_to_pb(await self.plane.get_transfer(request.group_id, request.wait_seconds))

    # -- status --------------------------------------------------------------

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        s = self.plane.status()
        return pb.StatusResponse(
            components=[component_to_pb(c) for c in s.components],
            versions=[
                pb.VersionInfo(
                    version=v.record.version, method=int(v.record.method), bytes=v.record.nbytes,
                    in_memory=v.in_memory, path=v.record.path, committed_unix_ms=v.record.committed_unix_ms,
                    identity=v.record.identity, epoch=v.record.epoch,
                )
                for v in s.versions
            ],
            latest_version=s.latest_version, policy=policy_to_pb(s.policy),
            transfers=[transfer_to_pb(g) for g in s.transfers], held_bytes=s.held_bytes,
            epoch=self.sync.epoch, rewound_to=self.sync.rewound_to,
        )

    async def GetVersion(self, request: pb.GetVersionRequest, context) -> pb.GetVersionResponse:
        return (await self.plane.get_version(request.version)).to_pb()

    # -- lineage -------------------------------------------------------------

    async def Rewind(self, request: pb.RewindRequest, context) -> pb.RewindResponse:
        r = self.sync.rewind(request.to_version, request.reason, start_over=request.start_over)
        return pb.RewindResponse(epoch=r.epoch, latest_version=r.latest_version, dropped_versions=r.dropped,
                                 rewinding=r.rewinding)

    async def RequestVersion(self, request: pb.RequestVersionRequest, context) -> pb.RequestVersionResponse:
        return pb.RequestVersionResponse(latest_version=self.sync.request_version(request.min_version, request.reason))

    # -- fleet updates -------------------------------------------------------

    async def ReportUpdate(self, request: pb.ReportUpdateRequest, context) -> pb.ReportUpdateResponse:
        return pb.ReportUpdateResponse(record=update_to_pb(self.sync.report_update(update_report_from_pb(request))))

    async def ListUpdates(self, request: pb.ListUpdatesRequest, context) -> pb.ListUpdatesResponse:
        return pb.ListUpdatesResponse(records=[update_to_pb(r) for r in self.sync.updates.records(request.version)])
