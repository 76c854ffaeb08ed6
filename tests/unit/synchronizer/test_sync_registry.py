"""Registry: the legal transition table, leases, re-registration, events."""

from __future__ import annotations

import itertools

import pytest

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.synchronizer.registry import LEGAL, Registry, check_transition
from flywheel.synchronizer.types import Component, EventKind, Identity, Role, State

S = State


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[Registry, Clock, list[tuple[str, State, EventKind, str]]]:
    seen: list[tuple[str, State, EventKind, str]] = []
    clock = Clock()
    registry = Registry(5.0, lambda c, kind, msg: seen.append((c.id, c.state, kind, msg)), clock)
    return registry, clock, seen


ALLOWED = {
    Role.TRAINER: {(S.RUNNING, S.WAITING_SYNC), (S.WAITING_SYNC, S.RUNNING)},
    Role.ROLLOUT: {(S.RUNNING, S.REQUIRE_SYNC), (S.REQUIRE_SYNC, S.WAITING_SYNC), (S.WAITING_SYNC, S.RUNNING),
                   (S.REQUIRE_SYNC, S.RUNNING)},
    Role.CONTROLLER: set(),
    Role.SYNCHRONIZER: set(),  # a relay is up or not
}


@pytest.mark.parametrize("role", list(Role))
def test_transition_table(role: Role) -> None:
    for frm, to in itertools.product(State, State):
        c = Component(Identity(role, "x"), state=frm)
        legal = frm == to or to == S.STOPPED or (frm == S.STOPPED and to == S.RUNNING) or (frm, to) in ALLOWED[role]
        if legal:
            check_transition(c, to)
        else:
            with pytest.raises(FailedPrecondition) as info:
                check_transition(c, to)
            assert frm.name in str(info.value) and to.name in str(info.value)
    assert LEGAL[role] - {(S.STOPPED, S.RUNNING)} == ALLOWED[role]


def test_register_heartbeat_and_lease_expiry() -> None:
    registry, clock, seen = make()
    registry.register(Identity(Role.ROLLOUT, "r0"), step=3, weight_version=2)
    registry.register(Identity(Role.TRAINER, "t0"), step=0, weight_version=0)
    clock.now += 4
    registry.heartbeat("t0", 5, 2)  # t0 renews, r0 does not
    clock.now += 2
    expired = registry.expire()
    assert [c.id for c in expired] == ["r0"]
    assert registry.get("r0").state == S.STOPPED and registry.get("t0").state == S.RUNNING
    assert ("r0", S.STOPPED, EventKind.COMPONENT_EXPIRED) == seen[-1][:3] and "lease expired" in seen[-1][3]
    assert registry.heartbeat("r0", 9, 9).state == S.STOPPED  # must register again
    assert registry.register(Identity(Role.ROLLOUT, "r0"), 9, 9).state == S.RUNNING


def test_register_rules() -> None:
    registry, _, _ = make()
    with pytest.raises(InvalidArgument):
        registry.register(Identity(Role.ROLLOUT, ""), 0, 0)
    registry.register(Identity(Role.ROLLOUT, "a"), 0, 0)
    with pytest.raises(AlreadyExists, match="taken by a running rollout"):
        registry.register(Identity(Role.TRAINER, "a"), 0, 0)
    with pytest.raises(NotFound, match="not registered"):
        registry.heartbeat("nobody", 0, 0)


def test_check_names_expected_state() -> None:
    registry, _, _ = make()
    c = registry.register(Identity(Role.ROLLOUT, "r"), 0, 0)
    with pytest.raises(FailedPrecondition, match="is RUNNING, not REQUIRE_SYNC"):
        registry.check(c, S.WAITING_SYNC, S.REQUIRE_SYNC)


def test_restore_gives_a_fresh_lease() -> None:
    registry, clock, _ = make()
    c = Component(Identity(Role.ROLLOUT, "r"), state=S.REQUIRE_SYNC, lease_expires=0.0)
    registry.restore([c])
    assert registry.expire() == []
    clock.now += 6
    assert [x.id for x in registry.expire()] == ["r"]


def test_heartbeats_only_move_versions_forward() -> None:
    registry, _, seen = make()
    registry.register(Identity(Role.ROLLOUT, "r"), step=1, weight_version=5)
    registry.heartbeat("r", 3, 4)  # sent before the version was raised: ignored
    assert (registry.get("r").step, registry.get("r").weight_version) == (3, 5)
    registry.heartbeat("r", 0, 0)  # a loop that tracks neither
    assert (registry.get("r").step, registry.get("r").weight_version) == (3, 5)
    registry.heartbeat("r", 4, 7)
    assert registry.get("r").weight_version == 7 and seen[-1][3] == "weight version changed"
