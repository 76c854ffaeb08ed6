"""Component registry: identities, states, the legal transitions, and leases.

Every change goes through `on_change(component, kind, message)` so the
service can publish it on Watch, persist it and update metrics in one place.
Transitions are checked against `LEGAL` per role; a same-state transition is
an idempotent no-op, and anything may stop. Leases run on a monotonic clock:
a component that misses its heartbeats for `lease_seconds` becomes STOPPED.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from flywheel.synchronizer.types import Component, EventKind, Identity, Role, State

S = State

#: Legal (from, to) transitions per role, besides `X -> STOPPED` and no-ops.
#: Trainer: RUNNING <-> WAITING_SYNC (NCCL broadcast); rollout:
#: RUNNING -> REQUIRE_SYNC -> [WAITING_SYNC (NCCL) ->] RUNNING, and back to
#: RUNNING from REQUIRE_SYNC (pulled, or the request timed out).
LEGAL: dict[Role, frozenset[tuple[State, State]]] = {
    Role.TRAINER: frozenset({(S.STOPPED, S.RUNNING), (S.RUNNING, S.WAITING_SYNC), (S.WAITING_SYNC, S.RUNNING)}),
    Role.ROLLOUT: frozenset({
        (S.STOPPED, S.RUNNING), (S.RUNNING, S.REQUIRE_SYNC), (S.REQUIRE_SYNC, S.RUNNING),
        (S.REQUIRE_SYNC, S.WAITING_SYNC), (S.WAITING_SYNC, S.RUNNING),
    }),
    Role.CONTROLLER: frozenset({(S.STOPPED, S.RUNNING)}),
    # A relay (services.synchronizer.relay) is up or not: it holds bytes, it never syncs.
    Role.SYNCHRONIZER: frozenset({(S.STOPPED, S.RUNNING)}),
}

OnChange = Callable[[Component, EventKind, str], None]


def check_transition(component: Component, to: State) -> None:
    """FailedPrecondition naming both states unless `component` may move to `to`."""
    frm = component.state
    if frm == to or to == S.STOPPED or (frm, to) in LEGAL[component.role]:
        return
    raise FailedPrecondition(
        f"{component.role.name.lower()} {component.id!r}: illegal transition {frm.name} -> {to.name}"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class Registry:
    def __init__(self, lease_seconds: float, on_change: OnChange, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self._on_change = on_change
        self._clock = clock
        self.components: dict[str, Component] = {}
        #: Component id -> the version a rewind sent it back to, while it still serves a newer
        #: one: its first report at or below that version is taken although it is lower.
        self.rewinding: dict[str, int] = {}

    def restore(self, components: Iterable[Component]) -> None:
        """Loads persisted components; each gets a fresh lease to heartbeat or re-register in."""
        for c in components:
            c.lease_expires = self._clock() + self.lease_seconds
            self.components[c.id] = c

    def get(self, component_id: str) -> Component:
        component = self.components.get(component_id)
        if component is None:
            raise NotFound(f"component {component_id!r} is not registered; register it first")
        return component

    def live(self, role: Role | None = None) -> list[Component]:
        """Components that are not STOPPED (of one role)."""
        return [c for c in self.components.values() if c.state != S.STOPPED and (role is None or c.role == role)]

    def renew(self, c: Component) -> None:
        c.lease_expires = self._clock() + self.lease_seconds
        c.last_heartbeat_ms = _now_ms()

    def register(self, identity: Identity, step: int, weight_version: int, weight_identity: bytes = b"") -> Component:
        if not identity.id:
            raise InvalidArgument("identity.id: empty")
        if identity.role not in LEGAL:
            raise InvalidArgument(
                f"identity.role: a component is a trainer, rollout, controller or relay synchronizer, "
                f"got {identity.role!r}"
            )
        old = self.components.get(identity.id)
        if old is not None and old.role != identity.role and old.state != S.STOPPED:
            raise AlreadyExists(
                f"id {identity.id!r} is taken by a running {old.role.name.lower()}; "
                f"stop it or pick another id for this {identity.role.name.lower()}"
            )
        c = Component(identity=identity, state=S.RUNNING, step=step, weight_version=weight_version,
                      weight_identity=weight_identity)
        self.rewinding.pop(identity.id, None)  # a registration says exactly what it holds
        if old is not None and old.role == identity.role:
            c.last_sync_step = old.last_sync_step
            # A quarantine ends only with a verified update: a replica that registers again (its heartbeat
            # found it forgotten, or its process restarted) holds nothing that proves its weights now.
            c.quarantined, c.quarantine_reason = old.quarantined, old.quarantine_reason
        self.renew(c)
        self.components[c.id] = c
        self._on_change(c, EventKind.COMPONENT_REGISTERED, "")
        return c

    def heartbeat(self, component_id: str, step: int, weight_version: int) -> Component:
        c = self.get(component_id)
        if c.state == S.STOPPED:
            return c  # a stopped component must register again; its lease is not renewed
        self.renew(c)
        # Versions only move forward here: a beat may have been sent before a
        # SetState that raised the version, and 0 means "not tracked". After a
        # rewind, the first beat at or below the rewound version is the way back.
        version_changed = weight_version > c.weight_version or self.went_back(c, weight_version)
        c.step = step or c.step
        c.weight_version = max(weight_version, c.weight_version)
        if version_changed:
            self._on_change(c, EventKind.STATE_CHANGED, "weight version changed")
        return c

    def went_back(self, c: Component, weight_version: int) -> bool:
        """Whether `weight_version` is `c` arriving at (or below) the version a rewind sent it
        back to; then it is recorded, and the rewind is over for `c`. Version 0 (the base
        model) counts only when the run started over: otherwise it is an engine not loaded."""
        floor = self.rewinding.get(c.id)
        if floor is None or weight_version > floor or (weight_version == 0 and floor > 0):
            return False
        del self.rewinding[c.id]
        c.weight_version = weight_version
        return True

    def check(self, c: Component, to: State, expected: State | None = None) -> None:
        """FailedPrecondition unless `c` is in `expected` (if given) and may move to `to`."""
        if expected is not None and c.state != expected:
            raise FailedPrecondition(
                f"{c.role.name.lower()} {c.id!r} is {c.state.name}, not {expected.name} as the caller expected"
            )
        check_transition(c, to)

    def touch(self, c: Component, message: str = "") -> None:
        """Reports a change other than the state (e.g. its weight version)."""
        self._on_change(c, EventKind.STATE_CHANGED, message)

    def move(self, c: Component, to: State, kind: EventKind = EventKind.STATE_CHANGED, message: str = "") -> None:
        """Sets a state without the legality check (the service's own choreography)."""
        c.state = to
        if to != S.REQUIRE_SYNC and to != S.WAITING_SYNC:
            c.requested_at = None
        self._on_change(c, kind, message)

    def expire(self) -> list[Component]:
        """Marks every component whose lease ended STOPPED; returns them."""
        now = self._clock()
        expired = [c for c in self.components.values() if c.state != S.STOPPED and c.lease_expires < now]
        for c in expired:
            reason = f"lease expired: no heartbeat for {self.lease_seconds:g}s"
            self.move(c, S.STOPPED, EventKind.COMPONENT_EXPIRED, reason)
        return expired

    def deregister(self, component_id: str) -> Component:
        c = self.get(component_id)
        if c.state != S.STOPPED:
            self.move(c, S.STOPPED, EventKind.STATE_CHANGED, "deregistered")
        return c
