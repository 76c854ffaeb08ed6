"""The synchronizer behind the controller's `Synchronizer` protocol: a thin
user of the shared typed client (`flywheel.synchronizer.client`).

The controller only configures the run's policy and reads versions; for
NCCL (a version that must reach replicas outside the policy's schedule, at
the start of a run or for validation) it allocates a group of every
registered replica, which the replicas join on their own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import WatchEvent
from services.controller.domain import NcclGroup

#: The controller's mode -> what a replica waits for before it generates for a run step.
ROLLOUT_WAIT = {"sync": "due_version", "batch-async": "staleness", "fully-async": "none"}


class GrpcSynchronizer:
    def __init__(self, address: str, *, trainer_id: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.address, self.trainer_id = address, trainer_id
        self.client = SynchronizerClient(address, token, timeout=timeout)

    async def close(self) -> None:
        await self.client.close()

    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float, mode: str,
        max_staleness: int,
    ) -> None:
        await self.client.configure_policy(
            style, method, interval, offset, timeout_seconds, rollout_wait=ROLLOUT_WAIT[mode],
            max_staleness=max_staleness,
        )

    def events(self, send_initial: bool) -> AsyncIterator[WatchEvent]:
        return self.client.watch([], send_initial=send_initial)

    async def latest_version(self) -> int:
        return (await self.client.status()).latest_version

    async def allocate_group(self, version: int, rollout_ids: Sequence[str], timeout_seconds: float) -> NcclGroup:
        group = await self.client.allocate_group(
            version, self.trainer_id, list(rollout_ids), timeout_seconds=timeout_seconds
        )
        return NcclGroup(group.group_id, group.rendezvous_address, group.world_size, group.backend, dict(group.ranks),
                         synchronizer_address=self.address)
