"""The synchronizer behind the controller's `Synchronizer` protocol.

The controller asks on the trainer's behalf (`trainer_id`): whether the step
just trained is a sync step, where a checkpoint version lives, and for NCCL
a process group. Rollout replicas are known to the controller by their
component id (`services.rollout[].id`) or, without one, by address; to the
synchronizer by component id. Allocating a group maps addresses to ids
through the synchronizer's status and hands the ranks back under the
controller's names.
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import FailedPrecondition
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc
from services.controller.adapters.errors import translated
from services.controller.adapters.trainer import METHODS
from services.controller.domain import NcclGroup, SyncDecision

STYLES = {"fixed": cpb.SYNC_STYLE_FIXED, "dynamic_by_explorer": cpb.SYNC_STYLE_DYNAMIC_BY_EXPLORER}


class GrpcSynchronizer:
    def __init__(self, address: str, *, trainer_id: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.address, self.trainer_id = address, trainer_id
        self.channel = open_channel(address, token=token, default_timeout=timeout)
        self.stub = pb_grpc.SynchronizerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float
    ) -> None:
        request = pb.ConfigurePolicyRequest(
            style=STYLES[style], method=METHODS[method], sync_interval=interval, sync_offset=offset,
            sync_timeout_seconds=timeout_seconds,
        )
        with translated(f"synchronizer {self.address} ConfigurePolicy"):
            await self.stub.ConfigurePolicy(request)

    async def need_sync(self, step: int) -> SyncDecision:
        with translated(f"synchronizer {self.address} NeedSync"):
            response = await self.stub.NeedSync(pb.NeedSyncRequest(id=self.trainer_id, step=step))
        return SyncDecision(response.need_sync, response.version)

    async def register_checkpoint(self, version: int, path: str) -> None:
        request = pb.RegisterCheckpointRequest(version=version, path=path, trainer_id=self.trainer_id)
        with translated(f"synchronizer {self.address} RegisterCheckpoint"):
            await self.stub.RegisterCheckpoint(request)

    async def allocate_group(self, version: int, rollout_ids: Sequence[str], timeout_seconds: float) -> NcclGroup:
        with translated(f"synchronizer {self.address} Status"):
            status = await self.stub.Status(pb.StatusRequest())
        # A replica is named by its component id (services.rollout[].id) or,
        # without one, by its address, which the registrations map to an id.
        ids = {c.identity.id for c in status.components}
        id_of = {c.identity.address: c.identity.id for c in status.components}
        resolved = {name: name if name in ids else id_of.get(name) for name in rollout_ids}
        missing = [name for name, cid in resolved.items() if cid is None]
        if missing:
            raise FailedPrecondition(f"rollout replicas {missing} are not registered with the synchronizer")
        request = pb.AllocateGroupRequest(
            version=version, trainer_id=self.trainer_id, rollout_ids=list(resolved.values()),
            timeout_seconds=timeout_seconds,
        )
        with translated(f"synchronizer {self.address} AllocateGroup"):
            response = await self.stub.AllocateGroup(request)
        # Ranks under the caller's names: each replica looks itself up by its name.
        name_of = {cid: name for name, cid in resolved.items()}
        ranks = {name_of.get(m.id, m.id): m.rank for m in response.members}
        return NcclGroup(response.group_id, response.rendezvous_address, response.world_size, response.backend, ranks,
                         synchronizer_address=self.address)
