"""Which rollout replicas the run uses: the synchronizer's registry decides.

The controller's pool is the set of rollout components registered with the
synchronizer (its event stream, `weights/observer.py`): a replica that registers is
added to the pool as not yet healthy, and takes work once its health check
says SERVING, which a replica reports only after it caught up to the newest
version (services/rollout/weights/follower.py). One that deregisters or whose lease
expires is marked down; its requests fail over to the others (balancer.py).
One that restarts on the same id registers again and comes back the same way.
The pool's version of each replica, and whether it is quarantined, are the
ones the synchronizer reports (this is their one writer).
`services.rollout` in the run config, when given, is a filter: replicas whose
id or address it does not name are left alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from flywheel.synchronizer.types import Component, Role, State
from services.controller.rollouts.balancer import EnginePool
from services.controller.rollouts.liveness import LivenessMonitor
from services.controller.protocols import HealthProbe, RolloutEngine

log = logging.getLogger(__name__)

#: (component id, address) -> the replica's engine client and its health probe, both named by the id.
Connect = Callable[[str, str], tuple[RolloutEngine, HealthProbe]]


class Membership:
    def __init__(
        self, engines: EnginePool, liveness: LivenessMonitor | None, connect: Connect | None,
        allowed: Iterable[str] = (),
    ) -> None:
        """`connect`: None for a fixed set of replicas (the simulated ones): only their versions and
        quarantine are followed."""
        self.engines, self.liveness, self.connect = engines, liveness, connect
        #: Ids or addresses of the replicas the run may use; empty: every registered one.
        self.allowed = frozenset(allowed)
        self._checks: set[asyncio.Task] = set()

    def admits(self, c: Component) -> bool:
        return not self.allowed or c.id in self.allowed or c.identity.address in self.allowed

    def update(self, c: Component) -> None:
        if c.role != Role.ROLLOUT or not self.admits(c):
            return
        if c.state == State.STOPPED:
            if c.id in self.engines:
                self.engines.mark(c.id, False, "left the synchronizer (deregistered or its lease expired)")
                if self.liveness is not None:
                    self.liveness.forget_health(c.id)  # a restart is marked up by its first passing check
            return
        if c.id in self.engines:
            self.engines.observe(c.id, c.weight_version, c.quarantined, c.quarantine_reason)
            return
        if not c.identity.address or self.connect is None:
            return
        engine, probe = self.connect(c.id, c.identity.address)
        self.engines.add(engine, healthy=self.liveness is None)
        self.engines.observe(c.id, c.weight_version, c.quarantined, c.quarantine_reason)
        if self.liveness is not None:
            self.liveness.add(probe, healthy=False)
            task = asyncio.ensure_future(self.liveness.check(c.id))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        log.info("rollout replica %s at %s registered: it takes work once it serves", c.id, c.identity.address)
