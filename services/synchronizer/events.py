"""Fan-out of synchronizer events to `Watch` subscribers.

`publish` never blocks and never awaits: each subscriber has its own bounded
queue, and one that falls `queue_size` events behind is cut off (its stream
ends with RESOURCE_EXHAUSTED, telling it to watch again with send_initial)
rather than slowing the service or silently missing events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flywheel.errors import ResourceExhausted
from flywheel.synchronizer.types import Component, EventKind, Method, TransferState


@dataclass(frozen=True)
class Event:
    kind: EventKind
    #: Monotonic event number, from 1.
    sequence: int
    unix_ms: int
    #: Newest committed version after the event.
    latest_version: int
    #: Snapshot of the component concerned (after the change), if any.
    component: Component | None = None
    version: int = 0
    method: Method | None = None
    #: Checkpoint path or group id.
    location: str = ""
    #: The transfer group (`services.synchronizer.groups.Group`), if any.
    group: Any = None
    transfer_state: TransferState | None = None
    message: str = ""
    #: Rewinds so far (the lineage) and the version the last one went back to.
    epoch: int = 0
    rewound_to: int = 0
    #: VERSION_COMMITTED, TRANSFER_FINISHED: the version's identity.
    identity: bytes = b""
    #: UPDATE_REPORTED: the result as recorded (flywheel.synchronizer.types.UpdateRecord).
    update: Any = None


class Subscription:
    """One watcher's queue; `get` raises ResourceExhausted once it overflowed, and returns None once
    it was closed (the service stops) and its queued events were taken."""

    def __init__(self, ids: frozenset[str], maxsize: int) -> None:
        self.ids = ids
        self._maxsize = maxsize
        self._queue: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._overflowed = False
        self._closed = False

    def wants(self, event: Event) -> bool:
        """Everything without an id filter; with one, events about those ids
        (a transfer concerns each of its members; versions concern everyone)."""
        if not self.ids:
            return True
        if event.component is not None:
            return event.component.id in self.ids
        if event.group is not None:
            return any(event.group.has(i) for i in self.ids)
        return True

    def offer(self, event: Event) -> bool:
        """Queues an event; False (and the subscription is dead) when full."""
        if self._overflowed:
            return False
        if len(self._queue) >= self._maxsize:
            self._overflowed = True
            self._queue.clear()
            self._ready.set()
            return False
        self._queue.append(event)
        self._ready.set()
        return True

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def get(self) -> Event | None:
        while not self._queue:
            if self._overflowed:
                raise ResourceExhausted(
                    f"watcher fell {self._maxsize} events behind and was dropped; watch again with send_initial"
                )
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()


class EventBus:
    def __init__(self, queue_size: int = 1024) -> None:
        self.queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._sequence = 0
        self.latest_version = 0
        #: The lineage every event carries (see `Synchronizer.rewind`).
        self.epoch = 0
        self.rewound_to = 0
        self._closed = False

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: EventKind, component: Component | None = None, **fields: Any) -> Event:
        self._sequence += 1
        snapshot = dataclasses.replace(component) if component is not None else None
        event = Event(
            kind=kind, sequence=self._sequence, unix_ms=int(time.time() * 1000),
            latest_version=self.latest_version, component=snapshot, epoch=self.epoch, rewound_to=self.rewound_to,
            **fields,
        )
        for sub in list(self._subscribers):
            if sub.wants(event) and not sub.offer(event):
                self._subscribers.discard(sub)
        return event

    def snapshot_events(self, components: Iterable[Component], ids: frozenset[str]) -> list[Event]:
        """The current state of every (wanted) component, as STATE_CHANGED events
        numbered with the current sequence (what a new watcher gets first)."""
        now = int(time.time() * 1000)
        return [
            Event(EventKind.STATE_CHANGED, self._sequence, now, self.latest_version, dataclasses.replace(c),
                  epoch=self.epoch, rewound_to=self.rewound_to)
            for c in components
            if not ids or c.id in ids
        ]

    def subscribe(self, ids: Iterable[str] = ()) -> Subscription:
        sub = Subscription(frozenset(ids), self.queue_size)
        self._subscribers.add(sub)
        if self._closed:
            sub.close()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def close(self) -> None:
        """Ends every subscription (the service stops): each watcher's stream ends once it has what was
        queued for it, instead of holding the server's shutdown grace period open."""
        self._closed = True
        for sub in self._subscribers:
            sub.close()
