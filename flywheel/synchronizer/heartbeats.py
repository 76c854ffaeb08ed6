"""A component's background heartbeat loop against the synchronizer.

Heartbeats every `interval` (a third of the lease by default) with the step
and weight version `progress()` reports (0 leaves a recorded value as it is). When the synchronizer no longer
knows the component (it restarted without a store) or has marked it STOPPED
(its lease ran out during a long pause), the loop registers it again with
the identity it last registered through the same client, so the run
continues, and tells `on_reregistered` (what the old synchronizer was told
and the new one was not, such as a rollout's proof of the weights it
serves, is the component's to tell again). A synchronizer that is down is retried on the next tick; the loop
never dies of a failed call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from flywheel.errors import FlywheelError, NotFound
from flywheel.synchronizer.types import State

if TYPE_CHECKING:
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.client_types import Beat

log = logging.getLogger(__name__)


class Heartbeats:
    def __init__(
        self,
        client: SynchronizerClient,
        component_id: str,
        progress: Callable[[], tuple[int, int]] | None = None,
        *,
        interval: float | None = None,
        on_beat: Callable[[Beat], None] | None = None,
        identity: Callable[[], bytes] = lambda: b"",
        on_reregistered: Callable[[], None] | None = None,
    ) -> None:
        self.client, self.component_id = client, component_id
        self.progress = progress or (lambda: (0, 0))
        #: The identity of the weights held (flywheel.codec.identity), told again on re-registration.
        self.identity = identity
        self.interval = interval
        self.on_beat = on_beat
        self.on_reregistered = on_reregistered
        self.task: asyncio.Task | None = None
        #: Times the loop registered the component again.
        self.reregistrations = 0
        self.last_error: Exception | None = None

    def start(self) -> Heartbeats:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.task = None

    async def __aenter__(self) -> Heartbeats:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def beat_once(self) -> None:
        step, version = self.progress()
        try:
            beat = await self.client.heartbeat(self.component_id, step, version)
        except NotFound:
            beat = None
        if beat is None or beat.state == State.STOPPED:
            if self.component_id not in self.client.identities:
                raise NotFound(f"{self.component_id!r} is not registered and this client never registered it")
            await self.client.reregister(self.component_id, step, version, self.identity())
            self.reregistrations += 1
            log.info("registered again with the synchronizer", extra={"id": self.component_id})
            if self.on_reregistered is not None:
                self.on_reregistered()
            return
        if self.on_beat is not None:
            self.on_beat(beat)

    async def _run(self) -> None:
        while True:
            try:
                await self.beat_once()
                self.last_error = None
            except FlywheelError as exc:
                self.last_error = exc
                log.warning("heartbeat failed", extra={"id": self.component_id, "error": str(exc)})
            # A third of the lease leaves room for two lost beats before expiry.
            await asyncio.sleep(self.interval or self.client.leases.get(self.component_id, 3.0) / 3)
