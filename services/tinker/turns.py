"""Turns on the one trainer, shared fairly between tenants.

Every model's requests run one at a time in turns of the trainer (services/tinker/models.py). With a
plain lock the turns go in the order they were asked for, so a tenant with eight models training at
once gets eight turns for every one of a tenant with one model, and a tenant that queues a long burst
is ahead of everyone who asks after it. Here, after each turn, the next goes to the waiting tenant
served least recently (one never served first; ties to the earliest waiter), first come first served
among that tenant's own waiters: tenants that wait take turns one after another, whatever their number
of models or requests. A waiter that gives up leaves the line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class FairTurns:
    def __init__(self) -> None:
        self._held = False
        #: Each waiting tenant's waiters, first come first.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        #: The number of the turn each tenant was last given (turns are numbered from 1).
        self._last_served: dict[str, int] = {}
        self._turns = 0
        #: Turns taken, by tenant (for /metrics and tests).
        self.taken: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        """The trainer is the caller's until the block ends."""
        if self._held or self._waiting:
            await self._wait(tenant)
        else:
            self._held = True
            self._served(tenant)
        try:
            yield
        finally:
            self._pass_on()

    def _served(self, tenant: str) -> None:
        self._turns += 1
        self._last_served[tenant] = self._turns
        self.taken[tenant] = self.taken.get(tenant, 0) + 1

    async def _wait(self, tenant: str) -> None:
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._pass_on()  # the turn came as the waiter was cancelled: the next one takes it
            else:
                self._forget(tenant, granted)
            raise

    def _forget(self, tenant: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self._waiting[tenant]

    def _pass_on(self) -> None:
        """The turn goes to the first waiter of the waiting tenant served least recently. No one waiting:
        the trainer is free."""
        while self._waiting:
            tenant = min(self._waiting, key=lambda t: self._last_served.get(t, 0))  # dicts keep arrival order
            queue = self._waiting[tenant]
            granted = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if not granted.cancelled():
                self._served(tenant)
                granted.set_result(None)
                return
        self._held = False
