"""The simulated synchronizer: the run's policy, the committed versions, the components and their
events, in memory; NeedSync answered by `flywheel.synchronizer.policy`, as the real one answers it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.policy import decide
from flywheel.synchronizer.types import (
    Component,
    EventKind,
    Identity,
    Method,
    Policy,
    Role,
    RolloutWait,
    State,
    Style,
    UpdateOutcome,
    UpdateRecord,
)

TRAINER_ID = "trainer"


@dataclass
class SimulatedSynchronizer:
    """The synchronizer's rules in memory: the policy, the committed versions, the components, events."""

    policy: Policy = field(default_factory=Policy)
    latest: int = 0
    #: The least version asked for outside the schedule and not committed yet (0: none).
    wanted: int = 0
    #: Every registered component, by id.
    registered: dict[str, Component] = field(default_factory=dict)
    #: Every update result the replicas reported, in order.
    results: list[UpdateRecord] = field(default_factory=list)
    configured: dict[str, Any] = field(default_factory=dict)
    #: UNVERIFIED updates leave the replica serving (the default quarantines it, as a failure).
    accept_unverified: bool = False
    #: Called when the trainer should ask NeedSync between steps (SimulatedTrainer.wake).
    wake_trainer: Callable[[], None] = lambda: None
    _subscribers: list[asyncio.Queue] = field(default_factory=list)
    _sequence: int = 0
    _committed: asyncio.Event | None = None

    # -- the controller's side (the Synchronizer protocol) ---------------------
    async def configure_policy(
        self, *, style: str, method: str, interval: int, offset: int, timeout_seconds: float, rollout_wait: str,
        max_staleness: int, pause_mode: str,
    ) -> None:
        self.configured = dict(style=style, method=method, interval=interval, offset=offset,
                               timeout_seconds=timeout_seconds, rollout_wait=rollout_wait,
                               max_staleness=max_staleness, pause_mode=pause_mode)
        self.policy = Policy(Style[style.upper()], Method[method.upper()], interval, offset, timeout_seconds,
                             RolloutWait[rollout_wait.upper()], max_staleness, pause_mode)

    async def events(self, send_initial: bool) -> AsyncIterator[WatchEvent]:
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            if send_initial:
                for c in list(self.registered.values()):
                    yield self._event(EventKind.STATE_CHANGED, c)
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(queue)

    async def latest_version(self) -> int:
        return self.latest

    async def components(self) -> list[Component]:
        return [replace(c) for c in self.registered.values()]

    async def updates(self, version: int) -> list[UpdateRecord]:
        return [r for r in self.results if r.version == version]

    async def request_version(self, min_version: int, reason: str) -> int:
        if self.latest < min_version:
            self.wanted = max(self.wanted, min_version)
            self._publish(EventKind.VERSION_REQUESTED, version=min_version, message=reason)
            self.wake_trainer()
        return self.latest

    # -- the services' side ----------------------------------------------------
    def register(self, role: Role, component_id: str) -> Component:
        c = Component(Identity(role, component_id, address=f"sim://{component_id}"))
        self.registered[component_id] = c
        self._publish(EventKind.COMPONENT_REGISTERED, c)
        return c

    def need_sync(self, component_id: str, step: int) -> Any:
        c = self.registered[component_id]
        c.step = step
        rollouts = [r for r in self.registered.values() if r.role == Role.ROLLOUT]
        decision = decide(self.policy, c, step, self.latest, rollouts, False, self.wanted)
        if decision.new_request:
            c.request_step, c.awaited_version = step, decision.version
            c.state = decision.state
            self._publish(EventKind.SYNC_REQUESTED, c, version=decision.version)
            self.wake_trainer()
        elif decision.state != c.state:
            c.state = decision.state
            self._publish(EventKind.STATE_CHANGED, c)
        return decision

    def commit(self, version: int) -> None:
        self.latest = max(self.latest, version)
        if self.wanted <= version:
            self.wanted = 0
        self.registered[TRAINER_ID].weight_version = version
        self._publish(EventKind.VERSION_COMMITTED, version=version, method=self.policy.method)
        event, self._committed = self._committed_event(), asyncio.Event()
        event.set()

    async def committed_after(self, version: int) -> int:
        """The newest committed version once it is newer than `version`."""
        while self.latest <= version:
            await self._committed_event().wait()
        return self.latest

    def report(self, record: UpdateRecord) -> None:
        c = self.registered[record.component_id]
        self.results.append(record)
        c.weight_version = record.served_version
        if record.verified or (record.outcome == UpdateOutcome.UNVERIFIED and self.accept_unverified):
            c.quarantined, c.quarantine_reason = False, ""
            if c.awaited_version and c.weight_version >= c.awaited_version:
                c.last_sync_step, c.state = max(c.last_sync_step, c.request_step), State.RUNNING
        elif record.outcome == UpdateOutcome.UNVERIFIED:
            c.quarantined, c.quarantine_reason = True, f"version {record.version} unverified: {record.reason}"
        else:
            phase = record.failed_phase.name.lower() if record.failed_phase else "update"
            c.quarantined = True
            c.quarantine_reason = f"{phase} of version {record.version} failed: {record.reason}"
        self._publish(EventKind.UPDATE_REPORTED, c, version=record.version, update=record)

    def _committed_event(self) -> asyncio.Event:
        if self._committed is None:
            self._committed = asyncio.Event()
        return self._committed

    def _event(self, kind: EventKind, component: Component | None = None, **fields: Any) -> WatchEvent:
        self._sequence += 1
        return WatchEvent(
            kind=kind, sequence=self._sequence, unix_ms=0, latest_version=self.latest,
            component=replace(component) if component is not None else None, version=fields.get("version", 0),
            method=fields.get("method"), location="", group=None, transfer_state=None,
            message=fields.get("message", ""), update=fields.get("update"),
        )

    def _publish(self, kind: EventKind, component: Component | None = None, **fields: Any) -> None:
        event = self._event(kind, component, **fields)
        for queue in self._subscribers:
            queue.put_nowait(event)
