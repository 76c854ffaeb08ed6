"""The controller's view of the weight plane: the synchronizer's event stream.

With a synchronizer, the controller moves no weights; it watches. Every event
(registrations, state changes, sync requests, committed versions, transfers)
is appended to `<run_dir>/synchronizer_events.jsonl`, one JSON object a line,
so a run shows who moved to which version when, step by step; listeners
(rollouts/membership.py) hear of every component change.
A broken stream is reopened with backoff; watching never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from flywheel.runtime.backoff import Backoff
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import Component, EventKind, Role
from services.controller.weights.newest import NewestVersion
from services.controller.weights.verdict import coverage_json

log = logging.getLogger(__name__)

EVENTS_FILE = "synchronizer_events.jsonl"
#: Events the status page's timeline shows: versions made and moved, members joining and leaving.
TIMELINE_KINDS = frozenset({
    EventKind.VERSION_COMMITTED, EventKind.TRANSFER_FINISHED, EventKind.COMPONENT_REGISTERED,
    EventKind.COMPONENT_EXPIRED, EventKind.UPDATE_REPORTED, EventKind.REWOUND,
})


def event_record(event: WatchEvent) -> dict[str, Any]:
    record: dict[str, Any] = {"sequence": event.sequence, "unix_ms": event.unix_ms, "kind": event.kind.name,
                              "latest_version": event.latest_version, "epoch": event.epoch}
    if event.component is not None:
        c = event.component
        record.update(id=c.id, role=c.role.name, state=c.state.name, step=c.step, weight_version=c.weight_version)
    if event.version:
        record["version"] = event.version
    if event.method is not None:
        record["method"] = event.method.name
    if event.group is not None:
        record["group"] = {"id": event.group.group_id, "ranks": event.group.ranks}
    if event.transfer_state is not None:
        record["transfer_state"] = event.transfer_state.name
    if event.message:
        record["message"] = event.message
    if event.identity:
        record["identity"] = event.identity.hex()
    if event.update is not None:
        u = event.update
        record["update"] = {
            "id": u.component_id, "version": u.version, "outcome": u.outcome.name,
            **({"identity": u.resident_identity.hex()} if u.resident_identity else {}),
            **({"reason": u.reason} if not u.verified else {}),
            **({"failed_phase": u.failed_phase.name} if u.failed_phase else {}),
            **{f"{phase}_seconds": round(getattr(u.timings, f"{phase}_seconds"), 6)
               for phase in ("admit", "transfer", "apply", "verify", "reopen", "pause")},
            "coverage": coverage_json(u),
        }
    if event.component is not None and event.component.quarantined:
        record["quarantined"] = event.component.quarantine_reason
    return record


class SynchronizerObserver:
    def __init__(
        self, events: Callable[[bool], AsyncIterator[WatchEvent]], run_dir: Path | None,
        ask_newest: Callable[[], Awaitable[int]] | None = None, newest: NewestVersion | None = None,
    ) -> None:
        #: Opens the synchronizer's event stream (True: current state first).
        self.events = events
        #: Asks the synchronizer for its newest version (catch_up).
        self.ask_newest = ask_newest
        #: The newest committed version as the run heard it (the fleet's: weights/newest.py); read only here.
        self.newest = newest
        self._observed = asyncio.Event()
        self.path = run_dir / EVENTS_FILE if run_dir is not None else None
        #: Called with the component of every event about one (rollouts/membership.py).
        self.listeners: list[Callable[[Component], None]] = []
        #: Called with every event (weights/fleet.py).
        self.event_listeners: list[Callable[[WatchEvent], None]] = []
        #: Every component as the synchronizer last reported it, by id (Status, the status page).
        self.components: dict[str, Component] = {}
        #: The latest TIMELINE_KINDS events as records (event_record), and WEIGHTS_APPLIED
        #: when a replica's version changes, oldest first.
        self.timeline: deque[dict[str, Any]] = deque(maxlen=500)

    def observe(self, event: WatchEvent) -> None:
        record = event_record(event)
        if event.component is not None:
            c = event.component
            before = self.components.get(c.id)
            if before is not None and c.weight_version != before.weight_version and c.role != Role.TRAINER:
                # A replica now serves another version: the sync as its users see it.
                self.timeline.append({"kind": "WEIGHTS_APPLIED", "unix_ms": event.unix_ms, "id": c.id,
                                      "version": c.weight_version, "from_version": before.weight_version})
            self.components[c.id] = c
        if event.kind in TIMELINE_KINDS:
            self.timeline.append(record)
        observed, self._observed = self._observed, asyncio.Event()
        observed.set()
        c = event.component
        for listener in self.listeners if c is not None else ():
            try:
                listener(c)
            except Exception:  # one listener's bug must not stop the stream
                log.exception("synchronizer event listener failed", extra={"id": c.id})
        for event_listener in self.event_listeners:
            try:
                event_listener(event)
            except Exception:  # one listener's bug must not stop the stream
                log.exception("synchronizer event listener failed", extra={"kind": event.kind.name})
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    async def catch_up(self, timeout: float) -> None:
        """Returns once the events up to the synchronizer's newest version were recorded (or
        after `timeout` seconds): the run's end must not cut off the last publish's events. The
        listeners (the fleet) have heard an event once it is observed here."""
        if self.ask_newest is None or self.newest is None:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            newest = await asyncio.wait_for(self.ask_newest(), timeout)
            while self.newest.value < newest:
                await asyncio.wait_for(self._observed.wait(), deadline - asyncio.get_running_loop().time())
        except Exception as exc:  # noqa: BLE001 - a short log is no reason to fail the run's end
            log.info("stopped watching before the newest version's events arrived", extra={"error": str(exc)})

    async def run(self) -> None:
        backoff = Backoff(0.2, 5.0)
        first = True
        while True:
            try:
                # The first stream starts with everyone's current state; a reopened one
                # would repeat it, so only new events are asked for then.
                async for event in self.events(first):
                    first = False
                    backoff.reset()
                    self.observe(event)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the run goes on without its log of events
                log.warning("watching the synchronizer failed; reconnecting", extra={"error": str(exc)})
            await backoff.wait()
