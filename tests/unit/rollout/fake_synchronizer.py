"""TEST DOUBLE of the synchronizer. Not the product synchronizer
(services/synchronizer): a real gRPC server answering just enough of
`SynchronizerService` for a rollout whose `synchronizer.address` names it.

What it is for: `PullWeights`, serving weight versions encoded from state
dicts the test adds, with knobs to corrupt one chunk's bytes, stop the stream
early or stall before the first chunk, so tests can show the rollout refuses
bad transfers.

What else it answers, minimally and consistently, because a rollout with a
synchronizer runs its link to it (services/rollout/weights/link.py):
- presence: Register (a lease, state RUNNING, the newest version held),
  Heartbeat (the recorded state; NOT_FOUND for an id not registered, as the
  product does, so the rollout registers again), SetState (records and
  echoes the state; FAILED_PRECONDITION when `expected_state` disagrees),
  Deregister;
- follower: Watch (stays open, sends nothing), NeedSync (never a sync:
  need_sync false, the newest version held, the default policy), Status (the
  components, the newest version held, the default policy, no versions
  listed);
- ReportUpdate (recorded, answered with the record as claimed), ListUpdates,
  RequestVersion (the newest version held), GetVersion (a held version's
  identity and tensor digests, from its manifest, and, when `model_dir` is
  set, the probe a trainer would publish with it).
It announces no version (no Watch event, none listed in Status, never a
NeedSync that says sync), so the rollout never pulls on its own: only its
UpdateWeights moves it.

Anything else (PushWeights, groups, checkpoints, policy changes, rewinds) is
UNIMPLEMENTED. Its state may be read and changed from any thread
(`running_in_thread` serves it on a loop of its own, for a rollout started
once per test module); `reset` forgets the versions, knobs and records of
the previous test.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import torch

from flywheel.codec import encode_state_dict
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.synchronizer.convert import policy_to_pb
from flywheel.synchronizer.types import Policy
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc

#: The policy it reports: the product's default (FIXED, MEMORY, interval 1; generations wait for nothing).
POLICY = policy_to_pb(Policy())


class FakeSynchronizer(pb_grpc.SynchronizerServiceServicer):
    def __init__(self, lease_seconds: float = 60.0) -> None:
        self.lease_seconds = lease_seconds
        self.versions: dict[int, object] = {}
        #: The model the versions are of: set, each version gets the trainer's probe (GetVersion serves it).
        self.model_dir: Path | None = None
        self.probes: dict[int, object] = {}
        #: version -> chunk sequence whose payload gets one byte flipped.
        self.corrupt: dict[int, int] = {}
        #: version -> number of chunks sent before the stream just ends.
        self.truncate: dict[int, int] = {}
        #: version -> seconds to stall before the first chunk.
        self.stall: dict[int, float] = {}
        self.pulls: list[int] = []
        #: id -> its status as registered, beaten and set.
        self.components: dict[str, cpb.ComponentStatus] = {}
        #: Every SetState received, in order.
        self.state_changes: list[pb.SetStateRequest] = []
        #: Every ReportUpdate received, as recorded.
        self.updates: list[pb.UpdateRecord] = []
        #: min_version of every RequestVersion received.
        self.version_requests: list[int] = []
        self._server: grpc.aio.Server | None = None
        self.address = ""

    # -- what tests set ---------------------------------------------------------

    def add(self, version: int, state: Mapping[str, torch.Tensor], chunk_bytes: int = 64 * 1024) -> None:
        """Holds `state` as `version`; with `model_dir` set, with the trainer's probe of it as well."""
        self.versions[version] = encode_state_dict(dict(state), version, chunk_bytes=chunk_bytes)
        if self.model_dir is not None:
            from tests.unit.rollout.rollout_helpers import probe_of

            try:
                self.probes[version] = probe_of(self.model_dir, dict(state))
            except RuntimeError:  # weights the model cannot take (a test's wrong shape): no probe
                self.probes.pop(version, None)

    def reset(self) -> None:
        """Forgets versions, knobs and records (not the registered components): a test starts clean."""
        for held in (self.versions, self.probes, self.corrupt, self.truncate, self.stall):
            held.clear()
        for recorded in (self.pulls, self.state_changes, self.updates, self.version_requests):
            recorded.clear()

    @property
    def latest(self) -> int:
        return max(self.versions, default=0)

    # -- weights ----------------------------------------------------------------

    async def PullWeights(self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext):
        self.pulls.append(request.version)
        encoded = self.versions.get(request.version)
        if encoded is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {request.version} not held")
        corrupt, truncate = self.corrupt.get(request.version, -1), self.truncate.get(request.version, -1)
        stall = self.stall.get(request.version)
        yield pb.PullWeightsResponse(manifest=encoded.manifest)
        if stall is not None:
            await asyncio.sleep(stall)
        for chunk in encoded.chunks():
            if chunk.sequence == truncate:
                return
            if chunk.sequence == corrupt:
                chunk = type(chunk).FromString(chunk.SerializeToString())
                data = bytearray(chunk.data)
                data[len(data) // 2] ^= 0x01
                chunk.data = bytes(data)
            yield pb.PullWeightsResponse(chunk=chunk)

    async def GetVersion(self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext) -> pb.GetVersionResponse:
        encoded = self.versions.get(request.version)
        if encoded is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {request.version} not held")
        manifest, probe = encoded.manifest, self.probes.get(request.version)
        return pb.GetVersionResponse(version=request.version, identity=manifest.identity,
                                     tensors=[pb.TensorDigest(name=t.name, digest=t.digest) for t in manifest.tensors],
                                     probe=probe.to_pb() if probe is not None else None)

    # -- presence ---------------------------------------------------------------

    async def _known(self, component_id: str, context: grpc.aio.ServicerContext) -> cpb.ComponentStatus:
        component = self.components.get(component_id)
        if component is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"component {component_id!r} is not registered")
        return component

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        self.components[request.identity.id] = cpb.ComponentStatus(
            identity=request.identity, state=cpb.COMPONENT_STATE_RUNNING, step=request.step,
            weight_version=request.weight_version, weight_identity=request.weight_identity,
            last_heartbeat_unix_ms=int(time.time() * 1000),
        )
        return pb.RegisterResponse(lease_seconds=self.lease_seconds, state=cpb.COMPONENT_STATE_RUNNING,
                                   latest_version=self.latest)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        component = await self._known(request.id, context)
        if request.step:
            component.step = request.step
        component.weight_version = max(component.weight_version, request.weight_version)
        component.last_heartbeat_unix_ms = int(time.time() * 1000)
        return pb.HeartbeatResponse(state=component.state, latest_version=self.latest)

    async def SetState(self, request: pb.SetStateRequest, context: grpc.aio.ServicerContext) -> pb.SetStateResponse:
        component = await self._known(request.id, context)
        if request.expected_state and request.expected_state != component.state:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.id} is {cpb.ComponentState.Name(component.state)}, "
                                f"not {cpb.ComponentState.Name(request.expected_state)}")
        self.state_changes.append(request)
        component.state = request.state
        if request.weight_version:
            component.weight_version = request.weight_version
            if request.weight_identity:
                component.weight_identity = request.weight_identity
        return pb.SetStateResponse(state=component.state)

    async def Deregister(self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext) -> pb.DeregisterResponse:
        await self._known(request.id, context)
        del self.components[request.id]
        return pb.DeregisterResponse()

    # -- the follower's view ----------------------------------------------------

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext):
        # Open until the caller hangs up or the server stops; nothing ever happens here.
        await asyncio.Event().wait()
        yield pb.WatchResponse()  # never reached: makes this a server-streaming handler

    async def NeedSync(self, request: pb.NeedSyncRequest, context: grpc.aio.ServicerContext) -> pb.NeedSyncResponse:
        component = await self._known(request.id, context)
        if request.step:
            component.step = request.step
        return pb.NeedSyncResponse(need_sync=False, state=component.state, method=cpb.SYNC_METHOD_MEMORY,
                                   latest_version=self.latest, policy=POLICY)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return pb.StatusResponse(components=list(self.components.values()), latest_version=self.latest, policy=POLICY)

    # -- the update ledger ------------------------------------------------------

    async def ReportUpdate(self, request: pb.ReportUpdateRequest,
                           context: grpc.aio.ServicerContext) -> pb.ReportUpdateResponse:
        encoded = self.versions.get(request.version)
        record = pb.UpdateRecord(
            component_id=request.id, version=request.version,
            expected_identity=encoded.manifest.identity if encoded is not None else b"",
            resident_identity=request.resident_identity, outcome=request.outcome, failed_phase=request.failed_phase,
            reason=request.reason, timings=request.timings, unix_ms=int(time.time() * 1000),
            served_version=request.served_version,
        )
        self.updates.append(record)
        return pb.ReportUpdateResponse(record=record)

    async def ListUpdates(self, request: pb.ListUpdatesRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListUpdatesResponse:
        records = [r for r in self.updates if not request.version or r.version == request.version]
        return pb.ListUpdatesResponse(records=sorted(records, key=lambda r: (r.version, r.component_id)))

    async def RequestVersion(self, request: pb.RequestVersionRequest,
                             context: grpc.aio.ServicerContext) -> pb.RequestVersionResponse:
        self.version_requests.append(request.min_version)
        return pb.RequestVersionResponse(latest_version=self.latest)

    # -- serving ----------------------------------------------------------------

    async def start(self) -> str:
        self._server = grpc.aio.server()
        pb_grpc.add_SynchronizerServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)


@contextlib.contextmanager
def running_in_thread(fake: FakeSynchronizer | None = None) -> Iterator[FakeSynchronizer]:
    """Serves `fake` (a new one by default) on an event loop of its own thread until the block
    exits: it outlives each test's loop, for a rollout a module-scoped fixture configures with
    its address."""
    from tests.unit.rollout.rollout_helpers import LoopThread

    fake = fake or FakeSynchronizer()
    loop = LoopThread("fake-synchronizer")
    try:
        loop.run(fake.start())
        try:
            yield fake
        finally:
            loop.run(fake.stop())
    finally:
        loop.close()
