"""Liveness of every remote service, by periodic health checks.

The monitor polls each `HealthProbe` (gRPC health in the product path) every
`interval` seconds. A rollout replica that fails is marked down in the
engine pool (requests fail over to the others) and up again when it passes;
its weights are then brought up to date by the weight-sync controller. The
trainer failing `max_failures` checks in a row is critical: nothing can
train. Changes are reported to the error reporter (warning for a replica,
critical for the trainer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.protocols import HealthProbe

log = logging.getLogger(__name__)


class LivenessMonitor:
    def __init__(
        self,
        probes: Sequence[HealthProbe],
        errors: ErrorReporter,
        *,
        interval: float = 5.0,
        critical: Sequence[str] = (),
        max_failures: int = 3,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.probes = list(probes)
        self.errors = errors
        self.interval = interval
        self.critical = set(critical)
        self.max_failures = max_failures
        self.on_change = on_change
        self.status: dict[str, bool] = {p.name: True for p in self.probes}
        self.failures: dict[str, int] = {p.name: 0 for p in self.probes}

    def add(self, probe: HealthProbe, *, healthy: bool = False) -> None:
        """Starts watching a service that joined (a rollout replica registering mid-run)."""
        if probe.name in self.status:
            return
        self.probes.append(probe)
        self.status[probe.name] = healthy
        self.failures[probe.name] = 0

    def forget_health(self, name: str) -> None:
        """The service is known to be gone (it left the synchronizer): its next passing check is news."""
        if name in self.status:
            self.status[name] = False

    async def check(self, name: str) -> bool:
        """Checks one service now (a replica that just joined need not wait a whole interval)."""
        probe = next(p for p in self.probes if p.name == name)
        ok = await self._check(probe)
        self._record(name, ok)
        return ok

    async def check_once(self) -> dict[str, bool]:
        results = await asyncio.gather(*(self._check(p) for p in self.probes))
        for probe, ok in zip(self.probes, results):
            self._record(probe.name, ok)
        return dict(self.status)

    async def _check(self, probe: HealthProbe) -> bool:
        try:
            return bool(await asyncio.wait_for(probe.check(), self.interval))
        except Exception:  # an unreachable service is the answer, not an error here
            return False

    def _record(self, name: str, ok: bool) -> None:
        self.failures[name] = 0 if ok else self.failures[name] + 1
        if ok != self.status[name]:
            self.status[name] = ok
            if self.on_change is not None:
                self.on_change(name, ok)
            if not ok and name not in self.critical:
                self.errors.report("liveness", f"{name} is not serving", severity="warning", context={"service": name})
        if name in self.critical and self.failures[name] == self.max_failures:
            self.errors.report(
                "liveness",
                f"{name} failed {self.max_failures} health checks in a row",
                severity="critical",
                context={"service": name},
            )

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval)
