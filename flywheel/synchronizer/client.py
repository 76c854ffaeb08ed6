"""Typed async client of the synchronizer, for the trainer, rollouts and the controller.

    async with SynchronizerClient("127.0.0.1:50051") as sync:
        await sync.register("rollout", "rollout-0", address="10.0.0.7:50061", capabilities=["memory"])
        async with sync.keep_alive("rollout-0", progress=lambda: (step, version)):
            decision = await sync.need_sync("rollout-0", step)
            if decision.need_sync:
                pulled = await sync.pull_weights(decision.version, at_least=True, into=model_state, wait_seconds=60)
                await sync.finish_sync("rollout-0", pulled.version)

    # trainer, MEMORY method: after each step (and while waiting for data)
    decision = await sync.need_sync("trainer-0", step)
    if decision.need_sync:
        await sync.push_weights(model.state_dict(), decision.version)

Every call has a deadline (`timeout`, or `transfer_timeout` for weight
streams, `watch_timeout` for Watch); failures raise `flywheel.errors`
exceptions carrying the gRPC status name in `code`. Weights travel as raw
frames (`flywheel.transfer.frames`): a push copies each payload once, a pull
(`flywheel.synchronizer.pull`) stages chunks straight from the received
bytes, or from shared memory on the synchronizer's host, through the codec's
`WeightAssembler` (all or nothing: `into` is untouched unless the whole
version arrived and verified).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import torch

from flywheel.codec import MAX_CHUNK_BYTES, EncodedVersion, encode_state_dict
from flywheel.codec.identity import VersionIdentity, manifest_identity
from flywheel.common.types import pause_mode_to_pb
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.probe import ProbeBatch
from flywheel.runtime.client import ChannelClient, client_streaming_call, domain_error, open_channel
from flywheel.runtime.tls import TlsFiles
from flywheel.transfer.frames import encoded_frames
from flywheel.runtime.server_config import MIB
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc
from flywheel.synchronizer.client_types import (
    Beat,
    DeltaBase,
    PullStats,
    Rewind,
    PulledWeights,
    PushResult,
    Registration,
    SyncDecision,
    SyncStatus,
    TransferOutcome,
    VersionProof,
    WatchEvent,
)
from flywheel.synchronizer.convert import (
    coverage_to_pb, group_from_pb, identity_to_pb, tensor_digests_to_pb, timings_to_pb, update_from_pb,
)
from flywheel.synchronizer.heartbeats import Heartbeats
from flywheel.synchronizer.pull import PullCall, pull_version
from flywheel.synchronizer.push import SharedPush, refused_shared_memory, remember_unmappable, shared_frames
from flywheel.synchronizer.types import (
    GroupInfo, Identity, Method, Role, RolloutWait, State, Style, TransferState, UpdateRecord, parse_enum,
)

_SERVICE = "/flywheel.synchronizer.v1.SynchronizerService/"


class SynchronizerClient(ChannelClient):
    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        transfer_timeout: float = 600.0,
        watch_timeout: float = 24 * 3600.0,
        max_message_bytes: int = 64 * MIB,
        shared_memory: bool = True,
        tls: TlsFiles | None = None,
        compress: bool | None = None,
        retry_unavailable: bool = True,
    ) -> None:
        """`tls`: default this process's (flywheel.runtime.tls). `compress`: ask for compressed chunks
        on pulls (None: once a pull measured the link slow; flywheel.synchronizer.pull).
        `retry_unavailable` False: a call the server cannot take (UNAVAILABLE) is not retried by the
        channel (a nearby source, passed over for the next one at once)."""
        self.address = address
        #: Read pulled versions in place, and write pushed ones to shared memory, when the synchronizer is on this host.
        self.shared_memory = shared_memory
        self.compress = compress
        self.timeout, self.transfer_timeout, self.watch_timeout = timeout, transfer_timeout, watch_timeout
        self.channel = open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes,
                                    tls=tls, **({} if retry_unavailable else {"max_attempts": 1}))
        self.stub = pb_grpc.SynchronizerServiceStub(self.channel)
        self._push = self.channel.stream_unary(
            _SERVICE + "PushWeights", request_serializer=None, response_deserializer=pb.PushWeightsResponse.FromString
        )
        self._pull = self.channel.unary_stream(
            _SERVICE + "PullWeights",
            request_serializer=pb.PullWeightsRequest.SerializeToString,
            response_deserializer=None,
        )
        #: Identities registered through this client (for re-registration) and their leases.
        self.identities: dict[str, Identity] = {}
        self.leases: dict[str, float] = {}

    async def _call(self, what: str, rpc, request, timeout: float | None = None):
        try:
            return await rpc(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, f"synchronizer {what}") from None

    # -- components ----------------------------------------------------------

    async def register(
        self,
        role: Role | str,
        component_id: str,
        *,
        address: str = "",
        capabilities: Iterable[Method | str] = (),
        labels: Mapping[str, str] | None = None,
        step: int = 0,
        weight_version: int = 0,
        weight_identity: bytes = b"",
    ) -> Registration:
        """`weight_identity`: the identity of the weights held (flywheel.codec.identity), b"" when unknown."""
        identity = Identity(
            parse_enum(Role, role, "role"), component_id, address,
            frozenset(parse_enum(Method, m, "capability") for m in capabilities), dict(labels or {}),
        )
        request = pb.RegisterRequest(identity=identity_to_pb(identity), step=step, weight_version=weight_version,
                                     weight_identity=weight_identity)
        r = await self._call("Register", self.stub.Register, request)
        self.identities[component_id] = identity
        self.leases[component_id] = r.lease_seconds
        return Registration(r.lease_seconds, State(r.state), r.latest_version, r.push_requested)

    async def reregister(
        self, component_id: str, step: int = 0, weight_version: int = 0, weight_identity: bytes = b"",
    ) -> Registration:
        """Registers again with the identity last registered through this client."""
        i = self.identities[component_id]
        return await self.register(
            i.role, i.id, address=i.address, capabilities=i.capabilities, labels=i.labels,
            step=step, weight_version=weight_version, weight_identity=weight_identity,
        )

    async def heartbeat(self, component_id: str, step: int = 0, weight_version: int = 0) -> Beat:
        request = pb.HeartbeatRequest(id=component_id, step=step, weight_version=weight_version)
        r = await self._call("Heartbeat", self.stub.Heartbeat, request)
        return Beat(State(r.state), r.latest_version, r.push_requested)

    def keep_alive(self, component_id: str, *args: Any, **kwargs: Any) -> Heartbeats:
        """A background heartbeat loop (an async context manager; or .start()/.stop()):
        `Heartbeats(self, component_id, ...)`, whose arguments and defaults the rest are."""
        return Heartbeats(self, component_id, *args, **kwargs)

    async def deregister(self, component_id: str, *, timeout: float | None = None) -> None:
        """`timeout`: the deadline over every attempt (default: the client's)."""
        await self._call("Deregister", self.stub.Deregister, pb.DeregisterRequest(id=component_id), timeout)

    async def set_state(
        self,
        component_id: str,
        state: State | str,
        *,
        expected: State | str | None = None,
        weight_version: int = 0,
        reason: str = "",
        weight_identity: bytes = b"",
    ) -> State:
        request = pb.SetStateRequest(
            id=component_id, state=int(parse_enum(State, state, "state")), weight_version=weight_version,
            reason=reason[:4000], weight_identity=weight_identity,
            expected_state=int(parse_enum(State, expected, "expected")) if expected is not None else 0,
        )
        return State((await self._call("SetState", self.stub.SetState, request)).state)

    async def finish_sync(self, component_id: str, version: int) -> State:
        """A rollout now serves `version` (after a pull or checkpoint load): back to RUNNING."""
        return await self.set_state(component_id, State.RUNNING, weight_version=version)

    async def watch(self, ids: Sequence[str] = (), *, send_initial: bool = True) -> AsyncIterator[WatchEvent]:
        """State, version and transfer events as they happen (ends at `watch_timeout`)."""
        call = self.stub.Watch(pb.WatchRequest(ids=list(ids), send_initial=send_initial), timeout=self.watch_timeout)
        try:
            async for response in call:
                yield WatchEvent.from_pb(response)
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, "synchronizer Watch") from None
        finally:
            call.cancel()

    # -- policy --------------------------------------------------------------

    async def configure_policy(
        self,
        style: Style | str,
        method: Method | str,
        interval: int,
        offset: int = 0,
        timeout_seconds: float = 0.0,
        rollout_wait: RolloutWait | str | None = None,
        max_staleness: int = 0,
        pause_mode: str | None = None,
    ) -> None:
        """Sets the run's policy; `rollout_wait` None keeps the current rule (and its max_staleness),
        `pause_mode` None keeps the current one ("abort", "wait" or "keep")."""
        request = pb.ConfigurePolicyRequest(
            style=int(parse_enum(Style, style, "style")), method=int(parse_enum(Method, method, "method")),
            sync_interval=interval, sync_offset=offset, sync_timeout_seconds=timeout_seconds,
            rollout_wait=int(parse_enum(RolloutWait, rollout_wait, "rollout_wait")) if rollout_wait else 0,
            max_staleness=max_staleness, pause_mode=pause_mode_to_pb(pause_mode),
        )
        await self._call("ConfigurePolicy", self.stub.ConfigurePolicy, request)

    async def need_sync(self, component_id: str, step: int) -> SyncDecision:
        r = await self._call("NeedSync", self.stub.NeedSync, pb.NeedSyncRequest(id=component_id, step=step))
        return SyncDecision.from_pb(r)

    # -- MEMORY --------------------------------------------------------------

    async def push_weights(
        self,
        weights: Mapping[str, torch.Tensor] | EncodedVersion,
        version: int | None = None,
        *,
        base_version: int = 0,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
        probe: ProbeBatch | None = None,
    ) -> PushResult:
        """Streams a version (a state dict, encoded here, or an EncodedVersion).

        `probe`: the trainer's probe of these weights (flywheel.probe), sent in the manifest
        (`WeightManifest.probe`, set on an EncodedVersion's own manifest) and recorded with
        the version beside the tensor digests the manifest carries.

        Chunks default to the largest that fits gRPC's default 4 MiB message:
        per-message costs dominate a Python gRPC stream, and 4 MiB chunks
        cost ~40% less CPU per byte end to end than 1 MiB (bench/weight_plane.py).
        With `shared_memory` (the client's), the payloads go through shared
        memory when the synchronizer is on this host (`flywheel.synchronizer.push`).
        """
        if isinstance(weights, EncodedVersion):
            if version is not None and version != weights.manifest.version:
                raise InvalidArgument(f"version {version} given for an encoded version {weights.manifest.version}")
            encoded = weights
        else:
            if version is None:
                raise InvalidArgument("push_weights needs the version of a state dict")
            encoded = await asyncio.to_thread(
                encode_state_dict, weights, version, base_version, chunk_bytes=chunk_bytes
            )
        if probe is not None:
            encoded.manifest.probe.CopyFrom(probe.to_pb())
        timeout = timeout or self.transfer_timeout
        with SharedPush(self.address, encoded, self.shared_memory) as segment:
            if segment is not None:
                try:
                    return await self._push_frames(lambda: shared_frames(encoded, segment), timeout)
                except FailedPrecondition as exc:
                    if not refused_shared_memory(exc):
                        raise
                    remember_unmappable(self.address, exc)
        return await self._push_frames(lambda: encoded_frames(encoded), timeout)

    async def _push_frames(self, frames: Callable[[], Iterable[bytes]], timeout: float) -> PushResult:
        try:
            r = await client_streaming_call(self._push, frames, timeout)
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, "synchronizer PushWeights") from None
        return PushResult(r.version, r.bytes, list(r.kept_versions))

    async def pull_weights(
        self,
        version: int = 0,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        wait_seconds: float = 0.0,
        at_least: bool = False,
        staging: Mapping[str, torch.Tensor] | None = None,
        check_manifest: Callable[[cpb.WeightManifest], None] | None = None,
        timeout: float | None = None,
        base: DeltaBase | None = None,
        retry_unreached: bool = True,
    ) -> PulledWeights:
        """Streams a version (0: the newest) and assembles it, all or nothing.

        `into`: tensors updated in place on success (untouched otherwise);
        None returns fresh CPU tensors. `wait_seconds`: wait for a version not
        pushed yet and stream it while it arrives (cut-through). `at_least`:
        `version` is a minimum (what NeedSync answers a rollout): the newest
        version >= it. `staging`: reusable staging tensors (see WeightAssembler).
        `check_manifest` sees the version's manifest before any chunk arrives
        and refuses the version by raising (a rollout checks it against the
        model it serves). `timeout`: the stream's deadline (default
        transfer_timeout + wait_seconds). The synchronizer's refusals raise
        their domain errors, status kept (NOT_FOUND: not held, e.g. evicted
        by a newer push). `base`: a verified version this reader holds, to be
        sent the version as a delta from (see `flywheel.synchronizer.pull`). A
        stream that breaks is resumed where it broke, each call within `timeout`;
        `retry_unreached` False: a synchronizer (or peer) that cannot be reached
        at all fails at once (UNAVAILABLE), instead of being asked again.
        """
        request = pb.PullWeightsRequest(version=version, wait_seconds=wait_seconds, at_least=at_least)
        stats = PullStats()
        deadline = timeout or (self.transfer_timeout + wait_seconds)
        try:
            manifest, tensors = await pull_version(
                lambda r: self._pull(r, timeout=deadline), request, synchronizer=self.address,
                shared_memory=self.shared_memory, check_manifest=check_manifest, into=into, staging=staging,
                base=base, stats=stats, compress=self.compress, retry_unreached=retry_unreached,
            )
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, f"synchronizer PullWeights from {self.address}") from None
        return PulledWeights(manifest.version, tensors, manifest.total_bytes, manifest_identity(manifest), stats)

    def pull_frames(self, request: pb.PullWeightsRequest, timeout: float) -> PullCall:
        """A PullWeights call whose responses are the raw frames (for a relay passing them on as they are)."""
        return self._pull(request, timeout=timeout)

    # -- CHECKPOINT ----------------------------------------------------------

    async def register_checkpoint(
        self, version: int, path: str, trainer_id: str = "", *, tensors: Mapping[str, bytes] | None = None,
        probe: ProbeBatch | None = None,
    ) -> int:
        """`tensors`: each tensor's identity digest, composing to the identity of the directory's
        `weight_manifest.pb`; `probe`: the trainer's probe of the version. Both are recorded with it."""
        request = pb.RegisterCheckpointRequest(version=version, path=str(path), trainer_id=trainer_id,
                                               tensors=tensor_digests_to_pb(tensors or {}))
        if probe is not None:
            request.probe.CopyFrom(probe.to_pb())
        return (await self._call("RegisterCheckpoint", self.stub.RegisterCheckpoint, request)).version

    async def get_checkpoint(self, version: int = 0) -> tuple[int, str]:
        r = await self._call("GetCheckpoint", self.stub.GetCheckpoint, pb.GetCheckpointRequest(version=version))
        return r.version, r.path

    # -- NCCL ----------------------------------------------------------------

    async def allocate_group(
        self,
        version: int,
        trainer_id: str,
        rollout_ids: Sequence[str] = (),
        *,
        timeout_seconds: float = 0.0,
        backend: str = "",
    ) -> GroupInfo:
        request = pb.AllocateGroupRequest(
            version=version, trainer_id=trainer_id, rollout_ids=list(rollout_ids),
            timeout_seconds=timeout_seconds, backend=backend,
        )
        group = group_from_pb(await self._call("AllocateGroup", self.stub.AllocateGroup, request))
        assert group is not None
        return group

    async def report_transfer(
        self, group_id: str, component_id: str, success: bool, error: str = "", *,
        identity: VersionIdentity | bytes = b"", probe: ProbeBatch | None = None,
    ) -> TransferState:
        """Rank 0 (the trainer), with success: `identity`, what it sent (a VersionIdentity sends each
        tensor's digest too), and `probe`, its probe of those weights; both are recorded with the version."""
        whole = identity if isinstance(identity, VersionIdentity) else VersionIdentity(identity)
        request = pb.ReportTransferRequest(group_id=group_id, id=component_id, success=success, error=error[:4000],
                                           identity=whole.digest, tensors=tensor_digests_to_pb(whole.tensors))
        if probe is not None:
            request.probe.CopyFrom(probe.to_pb())
        r = await self._call("ReportTransfer", self.stub.ReportTransfer, request)
        return TransferState(r.state)

    async def get_transfer(self, group_id: str, wait_seconds: float = 0.0) -> TransferOutcome:
        """The transfer's outcome, waiting up to `wait_seconds` while it is pending."""
        request = pb.GetTransferRequest(group_id=group_id, wait_seconds=wait_seconds)
        r = await self._call("GetTransfer", self.stub.GetTransfer, request, timeout=self.timeout + wait_seconds)
        return TransferOutcome.from_pb(r)

    # -- status --------------------------------------------------------------

    async def get_version(self, version: int) -> VersionProof:
        """What committed `version` is, as recorded at its commit: its identity, each tensor's digest and
        the trainer's probe (what a replica verifies the weights it loaded against). NOT_FOUND for a
        version not committed in the current lineage, or whose record is evicted."""
        r = await self._call("GetVersion", self.stub.GetVersion, pb.GetVersionRequest(version=version))
        return VersionProof.from_pb(r)

    async def status(self) -> SyncStatus:
        return SyncStatus.from_pb(await self._call("Status", self.stub.Status, pb.StatusRequest()))

    async def rewind(self, to_version: int, reason: str = "") -> Rewind:
        """Drops every version above `to_version` and sends the rollouts serving one back to it
        (the trainer resumed from the checkpoint of step `to_version`). 0 starts over from the
        base model (the trainer restarted with no checkpoint): the request says so explicitly."""
        request = pb.RewindRequest(to_version=to_version, reason=reason[:4000], start_over=to_version == 0)
        return Rewind.from_pb(await self._call("Rewind", self.stub.Rewind, request))


    async def request_version(self, min_version: int, reason: str = "") -> int:
        """Asks for a version >= `min_version` outside the schedule (the trainer publishes its weights
        once it holds one); returns the newest committed version now."""
        request = pb.RequestVersionRequest(min_version=min_version, reason=reason[:4000])
        return (await self._call("RequestVersion", self.stub.RequestVersion, request)).latest_version

    # -- fleet updates -------------------------------------------------------

    async def report_update(self, report: UpdateRecord) -> UpdateRecord:
        """A rollout's result of one weight update; returns it as recorded, with the synchronizer's verdict."""
        r = report
        request = pb.ReportUpdateRequest(
            id=r.component_id, version=r.version, resident_identity=r.resident_identity, outcome=int(r.outcome),
            failed_phase=int(r.failed_phase) if r.failed_phase else 0, reason=r.reason[:4000],
            timings=timings_to_pb(r.timings), served_version=r.served_version, coverage=coverage_to_pb(r.coverage),
        )
        return update_from_pb((await self._call("ReportUpdate", self.stub.ReportUpdate, request)).record)

    async def list_updates(self, version: int = 0) -> list[UpdateRecord]:
        """The recorded update results of `version` (0: every version kept), oldest version first."""
        r = await self._call("ListUpdates", self.stub.ListUpdates, pb.ListUpdatesRequest(version=version))
        return [update_from_pb(u) for u in r.records]
