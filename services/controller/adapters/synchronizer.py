"""The synchronizer behind the controller's `Synchronizer` protocol: a thin
user of the shared typed client (`flywheel.synchronizer.client`).

The controller configures the run's policy, reads versions and events, and
asks for the versions the run needs outside the schedule; it moves no
weights (services/controller/weights/fleet.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import Component, UpdateRecord


class GrpcSynchronizer:
    def __init__(self, address: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.address = address
        self.client = SynchronizerClient(address, token, timeout=timeout)

    async def close(self) -> None:
        await self.client.close()

    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float, rollout_wait: str,
        max_staleness: int, pause_mode: str,
    ) -> None:
        await self.client.configure_policy(
            style, method, interval, offset, timeout_seconds, rollout_wait=rollout_wait,
            max_staleness=max_staleness, pause_mode=pause_mode,
        )

    def events(self, send_initial: bool) -> AsyncIterator[WatchEvent]:
        return self.client.watch([], send_initial=send_initial)

    async def latest_version(self) -> int:
        return (await self.client.status()).latest_version

    async def components(self) -> list[Component]:
        return (await self.client.status()).components

    async def request_version(self, min_version: int, reason: str) -> int:
        return await self.client.request_version(min_version, reason)

    async def updates(self, version: int) -> list[UpdateRecord]:
        return await self.client.list_updates(version)
