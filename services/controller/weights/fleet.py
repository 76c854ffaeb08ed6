"""The fleet's weights from the controller's seat: the policy it hands over,
the versions it asks for, and its verdict on every update.

One road (docs/architecture.md, "Who moves the weights"): the synchronizer
owns versions, the trainer publishes them, every replica follows the policy
by its own steps and reports each update it makes. The controller:

- `configure()` hands the synchronizer the run's policy: style, interval,
  offset, method, timeout, what a replica waits for before it generates for
  a run step (from the mode: sync -> the version due at its step,
  batch-async -> at most `staleness.threshold` behind, fully-async ->
  nothing) and the pause mode (`sync.pause_mode`: what a replica does with
  its in-flight requests while it swaps);
- `need(version)` asks for a version the run needs outside the schedule
  (its start or resume, a validation measuring the weights it names) and
  waits until it is committed, within `sync.timeout_seconds`: the trainer
  publishes it (RequestVersion), the replicas reach it because the requests
  that need it name it;
- `observe(event)` keeps what every replica reported of every update
  (UPDATE_REPORTED): per version, the fleet's verdict is "every live replica
  verified it, or is quarantined with a reason". Quarantine itself is the
  synchronizer's flag on the replica, which the pool reads (rollouts/balancer.py): no
  traffic until an update of that replica verifies;
- `after_step(result)` lets the staleness gate dispatch against the
  trainer's new version.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import EventKind, Role, State, UpdateRecord
from services.controller.rollouts.balancer import EnginePool
from services.controller.domain import TrainResult
from services.controller.protocols import Synchronizer
from services.controller.batches.staleness import StalenessGate

log = logging.getLogger(__name__)

#: The phases of a replica's update, as the step metrics name them (update/<phase>_seconds_*).
PHASES = ("admit", "transfer", "apply", "verify", "reopen", "pause")
#: The mode -> what a replica waits for before it generates for a run step (the policy's rollout_wait).
ROLLOUT_WAIT = {"sync": "due_version", "batch-async": "staleness", "fully-async": "none"}


class VersionNotPublished(RuntimeError):
    """A version the run needs was not committed in time."""


@dataclass
class FleetVerdict:
    """What the fleet made of one version."""

    version: int
    verified: list[str] = field(default_factory=list)
    #: Replica -> why it is out of service.
    quarantined: dict[str, str] = field(default_factory=dict)
    #: Live replicas with no result for this version yet.
    pending: list[str] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        """Every live replica verified the version or is quarantined with a reason."""
        return not self.pending


class Fleet:
    def __init__(
        self,
        synchronizer: Synchronizer,
        engines: EnginePool,
        gate: StalenessGate,
        *,
        mode: str,
        method: str,
        style: str,
        interval: int,
        offset: int,
        pause_mode: str,
        timeout_seconds: float,
        keep_versions: int = 64,
    ) -> None:
        self.synchronizer, self.engines, self.gate = synchronizer, engines, gate
        self.mode, self.method, self.style = mode, method, style
        self.interval, self.offset, self.pause_mode = interval, offset, pause_mode
        self.timeout_seconds = timeout_seconds
        #: Newest committed version heard of.
        self.latest = 0
        #: version -> replica -> its latest reported result (the last `keep_versions` versions).
        self.results: dict[int, dict[str, UpdateRecord]] = {}
        self.keep_versions = keep_versions
        #: Results reported since the last step's metrics were taken (`take_step_metrics`).
        self._since_step: deque[UpdateRecord] = deque(maxlen=10_000)
        self._committed = asyncio.Event()
        #: Called with every result as it arrives (the run's timeline, its ledger).
        self.listeners: list[Callable[[UpdateRecord], None]] = []

    # -- what the controller tells the synchronizer ---------------------------

    async def configure(self) -> None:
        """Hands the run's policy to the synchronizer (it answers NeedSync by it)."""
        await self.synchronizer.configure_policy(
            style=self.style, method=self.method, interval=self.interval, offset=self.offset,
            timeout_seconds=self.timeout_seconds, rollout_wait=ROLLOUT_WAIT[self.mode],
            max_staleness=self.gate.limit or 0, pause_mode=self.pause_mode,
        )

    async def need(self, version: int, reason: str) -> None:
        """Returns once `version` (or a newer one) is committed; the trainer is asked to publish it
        if the schedule does not. VersionNotPublished after `sync.timeout_seconds`."""
        if version < 1:
            return  # version 0 is the base model every replica loads
        latest = await self.synchronizer.request_version(version, reason)
        self._heard(latest)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        while self.latest < version:
            left = deadline - loop.time()
            if left <= 0:
                # Ask the synchronizer itself: its events may have been missed.
                self._heard(await self.synchronizer.latest_version())
                if self.latest >= version:
                    return
                raise VersionNotPublished(
                    f"version {version} ({reason}) was not published within {self.timeout_seconds:g} s "
                    f"(sync.timeout_seconds); the newest committed is {self.latest}. Is the trainer publishing "
                    "(its sync.publish) and registered with the synchronizer?")
            try:
                await asyncio.wait_for(self._committed.wait(), min(left, 1.0))
            except TimeoutError:
                self._heard(await self.synchronizer.latest_version())

    async def ahead_of(self, version: int) -> list[str]:
        """Live rollouts the synchronizer says serve a version newer than `version` (the trainer's)."""
        return [c.id for c in await self.synchronizer.components()
                if c.role == Role.ROLLOUT and c.state != State.STOPPED and c.weight_version > version]

    def after_step(self, result: TrainResult) -> None:
        # The trainer published whatever was due before its step answered; replicas follow on
        # their own, waiting where the mode says. The next batch may now be dispatched.
        self.gate.set_rollout_version(result.version)

    # -- what the synchronizer tells the controller ---------------------------

    def _heard(self, latest: int) -> None:
        if latest > self.latest:
            self.latest = latest
            event, self._committed = self._committed, asyncio.Event()
            event.set()

    def observe(self, event: WatchEvent) -> None:
        self._heard(event.latest_version)
        if event.kind == EventKind.REWOUND:
            self.latest = event.latest_version
            for version in [v for v in self.results if v > event.version]:
                del self.results[version]
        if event.kind != EventKind.UPDATE_REPORTED or event.update is None:
            return
        record = event.update
        self.results.setdefault(record.version, {})[record.component_id] = record
        for old in sorted(self.results)[: -self.keep_versions]:
            del self.results[old]
        self._since_step.append(record)
        if not record.verified:
            log.warning("rollout %s failed its update to version %d (%s): %s", record.component_id, record.version,
                        record.failed_phase.name.lower() if record.failed_phase else "?", record.reason)
        for listener in self.listeners:
            listener(record)

    # -- the fleet's verdict --------------------------------------------------

    def verdict(self, version: int) -> FleetVerdict:
        """Per live replica of the pool: verified `version` (or a newer one), quarantined, or still pending."""
        verdict = FleetVerdict(version)
        for replica in self.engines.replicas:
            if replica.quarantined:
                verdict.quarantined[replica.name] = replica.quarantine_reason
            elif any(r.verified and r.component_id == replica.name
                     for v, results in self.results.items() if v >= version for r in results.values()):
                verdict.verified.append(replica.name)
            elif replica.healthy:
                verdict.pending.append(replica.name)
        return verdict

    def take_step_metrics(self) -> dict[str, float]:
        """The updates reported since the last call, as step metrics: per phase the slowest and the
        mean replica (update/<phase>_seconds_max|mean), counts, and the replicas quarantined now."""
        records = list(self._since_step)
        self._since_step.clear()
        m: dict[str, float] = {
            "update/verified": float(sum(r.verified for r in records)),
            "update/failed": float(sum(not r.verified for r in records)),
            "fleet/quarantined": float(sum(r.quarantined for r in self.engines.replicas)),
        }
        for phase in PHASES:
            values = [getattr(r.timings, f"{phase}_seconds") for r in records if r.verified]
            if values:
                m[f"update/{phase}_seconds_max"] = max(values)
                m[f"update/{phase}_seconds_mean"] = statistics.fmean(values)
        return m
