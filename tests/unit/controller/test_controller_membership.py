"""Membership from the synchronizer's registry: replicas join the pool as they
register, take work only once their health check passes (a replica serves only
after catching up), leave it when they deregister or expire, come back after a
restart, and a run-config filter keeps the others out."""

from __future__ import annotations

import asyncio

from flywheel.synchronizer.types import Component, Identity, Role, State
from services.controller.rollouts.balancer import EnginePool
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.rollouts.liveness import LivenessMonitor
from services.controller.rollouts.membership import Membership
from services.controller.testing.simulated import SimulatedHealthProbe, SimulatedRolloutEngine


def rollout(cid: str, address: str, state: State = State.RUNNING, role: Role = Role.ROLLOUT) -> Component:
    return Component(Identity(role, cid, address), state=state)


class Replicas:
    """What the controller's connect() would build, with a health switch per replica."""

    def __init__(self) -> None:
        self.serving: dict[str, bool] = {}
        self.connected: list[tuple[str, str]] = []

    def connect(self, cid: str, address: str):
        self.connected.append((cid, address))
        self.serving.setdefault(cid, False)
        return SimulatedRolloutEngine(name=cid), SimulatedHealthProbe(cid, lambda: self.serving[cid])


async def test_replicas_join_when_registered_and_serve_once_healthy() -> None:
    replicas = Replicas()
    engines = EnginePool([], dynamic=True)
    liveness = LivenessMonitor([], ErrorReporter(), interval=0.05, on_change=lambda n, ok: engines.mark(n, ok))
    membership = Membership(engines, liveness, replicas.connect)
    membership.update(rollout("r0", "10.0.0.1:50053"))
    membership.update(rollout("trainer-0", "10.0.0.9:50052", role=Role.TRAINER))  # not a replica
    membership.update(rollout("r0", "10.0.0.1:50053"))  # a second event about it adds nothing
    assert replicas.connected == [("r0", "10.0.0.1:50053")] and len(engines) == 1
    await asyncio.sleep(0.05)
    assert engines.healthy() == [], "registered but still catching up: no work yet"
    replicas.serving["r0"] = True
    await liveness.check_once()
    assert [r.name for r in engines.healthy()] == ["r0"]
    # It leaves: deregistered (or its lease expired). Requests go elsewhere.
    membership.update(rollout("r0", "10.0.0.1:50053", state=State.STOPPED))
    assert engines.healthy() == []
    # Restarted on the same address: the same id registers again; it serves once its check passes.
    membership.update(rollout("r0", "10.0.0.1:50053"))
    await liveness.check_once()
    assert [r.name for r in engines.healthy()] == ["r0"] and replicas.connected == [("r0", "10.0.0.1:50053")]


async def test_the_run_config_list_is_a_filter_by_id_or_address() -> None:
    replicas = Replicas()
    engines = EnginePool([], dynamic=True)
    membership = Membership(engines, None, replicas.connect, allowed=["r1", "10.0.0.3:50053"])
    for i in range(4):
        membership.update(rollout(f"r{i}", f"10.0.0.{i}:50053"))
    assert [c for c, _ in replicas.connected] == ["r1", "r3"]
    # Without a liveness monitor a joined replica serves at once.
    assert [r.name for r in engines.healthy()] == ["r1", "r3"]


def test_the_pool_takes_each_replicas_version_from_the_synchronizer() -> None:
    """Including down: a restarted replica registers on its base weights, which samples and updates
    (they only ever raise it) would never say."""
    engines = EnginePool([], dynamic=True)
    membership = Membership(engines, None, Replicas().connect)
    for cid, version in (("r0", 3), ("r1", 2)):
        c = rollout(cid, f"10.0.0.{cid[-1]}:50053")
        c.weight_version = version
        membership.update(c)
    assert engines.min_version() == 2
    moved = rollout("r1", "10.0.0.1:50053")
    moved.weight_version = 4
    membership.update(moved)
    assert engines.replica("r1").version == 4 and engines.min_version() == 3
    restarted = rollout("r0", "10.0.0.0:50053")  # registers again on version 0
    membership.update(restarted)
    assert engines.replica("r0").version == 0


def test_a_fixed_pool_still_needs_a_replica() -> None:
    try:
        EnginePool([])
    except ValueError as exc:
        assert "at least one" in str(exc)
    else:
        raise AssertionError("an empty fixed pool must be refused")
    assert EnginePool([], dynamic=True).min_version() == 0
