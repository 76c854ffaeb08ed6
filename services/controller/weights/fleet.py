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
  (UPDATE_REPORTED, with what it measured: `UpdateCoverage`) and the newest
  committed version (`newest`, its one holder in the controller:
  weights/newest.py). Quarantine itself is the synchronizer's flag on the
  replica, which the pool reads (rollouts/balancer.py): no traffic until an
  update of that replica verifies;
- `verdict(version)` is the fleet's verdict on a version (weights/verdict.py),
  and `until_usable(versions)` waits, within `sync.verify_timeout_seconds`,
  until each version a batch's tokens came from has one: a replica that
  verified it (or one serving it unverified under a policy that accepts
  that). The pipeline asks before every train step and stops the run when a
  version has none (pipeline.py, `weights_verified`);
- `after_step(result)` lets the staleness gate dispatch against the
  trainer's new version.

Why the wait sits before training and not before generation: replicas move
to a version when work of a new step reaches them (their steps, the one
road), so a controller that held generation back until a replica had
verified the version would wait for a move that waits for it. Generation is
held where it is safe, at each replica (its update's verify phase closes its
gate on failure, and a quarantined replica gets no traffic); the controller
holds what it owns, the train step, and trains on no token of a version no
replica proved. A replica reports before it generates on the version, so
the report is normally in before the tokens are: the wait costs nothing then.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import TIMED_PHASES, EventKind, Role, State, UpdateOutcome, UpdateRecord
from services.controller.rollouts.balancer import EnginePool
from services.controller.domain import TrainResult
from services.controller.protocols import Synchronizer
from services.controller.batches.staleness import StalenessGate
from services.controller.weights.newest import NewestVersion
from services.controller.weights.verdict import FleetVerdict, judge, verdict_json, verdict_metrics

log = logging.getLogger(__name__)

#: The mode -> what a replica waits for before it generates for a run step (the policy's rollout_wait).
ROLLOUT_WAIT = {"sync": "due_version", "batch-async": "staleness", "fully-async": "none"}


#: How many versions trained on the status page shows the verdict of (the newest).
JUDGED_SHOWN = 20
#: While a verdict waits, how often the synchronizer is asked for the reports (`until_usable`): a
#: report its Watch stream did not bring (a synchronizer restarted, its stream not yet back) is then
#: found within this, not at the end of sync.verify_timeout_seconds (120 s by default).
REASK_REPORTS_SECONDS = 2.0


class VersionNotPublished(RuntimeError):
    """A version the run needs was not committed in time."""


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
        verify_timeout_seconds: float | None = None,
        keep_versions: int = 64,
    ) -> None:
        self.synchronizer, self.engines, self.gate = synchronizer, engines, gate
        self.mode, self.method, self.style = mode, method, style
        self.interval, self.offset, self.pause_mode = interval, offset, pause_mode
        self.timeout_seconds = timeout_seconds
        #: How long a train step waits for a replica's proof of the versions its tokens came from.
        self.verify_timeout_seconds = verify_timeout_seconds or timeout_seconds
        #: The newest committed version: its one holder in the controller; this class is its one writer.
        self.newest = NewestVersion()
        #: version -> replica -> its latest reported result (the last `keep_versions` versions).
        self.results: dict[int, dict[str, UpdateRecord]] = {}
        self.keep_versions = keep_versions
        #: Results reported since the last step's metrics were taken (`take_step_metrics`).
        self._since_step: deque[UpdateRecord] = deque(maxlen=10_000)
        #: Set at every report and every change of a replica (what a verdict is made of).
        self._reported = asyncio.Event()
        #: The versions train steps were checked for (newest last), and the seconds spent waiting
        #: for their proof since the last step's metrics.
        self.judged: deque[int] = deque(maxlen=JUDGED_SHOWN)
        self._waited_since_step = 0.0
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
        self.newest.heard(await self.synchronizer.request_version(version, reason))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        while self.newest.value < version:
            left = deadline - loop.time()
            if left <= 0:
                # Ask the synchronizer itself: its events may have been missed.
                self.newest.heard(await self.synchronizer.latest_version())
                if self.newest.value >= version:
                    return
                raise VersionNotPublished(
                    f"version {version} ({reason}) was not published within {self.timeout_seconds:g} s "
                    f"(sync.timeout_seconds); the newest committed is {self.newest.value}. Is the trainer publishing "
                    "(its sync.publish) and registered with the synchronizer?")
            try:
                await asyncio.wait_for(self.newest.changed().wait(), min(left, 1.0))
            except TimeoutError:
                self.newest.heard(await self.synchronizer.latest_version())

    async def ahead_of(self, version: int) -> list[str]:
        """Live rollouts the synchronizer says serve a version newer than `version` (the trainer's)."""
        return [c.id for c in await self.synchronizer.components()
                if c.role == Role.ROLLOUT and c.state != State.STOPPED and c.weight_version > version]

    def after_step(self, result: TrainResult) -> None:
        # The trainer published whatever was due before its step answered; replicas follow on
        # their own, waiting where the mode says. The next batch may now be dispatched.
        self.gate.set_rollout_version(result.version)

    # -- what the synchronizer tells the controller ---------------------------

    def observe(self, event: WatchEvent) -> None:
        if event.kind == EventKind.REWOUND:
            self.newest.rewound(event.latest_version)
            for version in [v for v in self.results if v > event.version]:
                del self.results[version]
        else:
            self.newest.heard(event.latest_version)
        if event.component is not None:
            self._changed()  # a quarantine set or lifted changes verdicts too
        if event.kind != EventKind.UPDATE_REPORTED or event.update is None:
            return
        self._record(event.update)

    def _record(self, record: UpdateRecord) -> None:
        self.results.setdefault(record.version, {})[record.component_id] = record
        for old in sorted(self.results)[: -self.keep_versions]:
            del self.results[old]
        self._since_step.append(record)
        if record.outcome == UpdateOutcome.UNVERIFIED:
            log.warning("rollout %s could not prove version %d: %s", record.component_id, record.version,
                        record.coverage.describe())
        elif not record.verified:
            log.warning("rollout %s failed its update to version %d (%s): %s", record.component_id, record.version,
                        record.failed_phase.name.lower() if record.failed_phase else "?", record.reason)
        self._changed()
        for listener in self.listeners:
            listener(record)

    def _changed(self) -> None:
        event, self._reported = self._reported, asyncio.Event()
        event.set()

    # -- the fleet's verdict --------------------------------------------------

    def verdict(self, version: int) -> FleetVerdict:
        """Per live replica of the pool: verified `version` (or a newer one), quarantined, serving it
        unverified, or still pending (weights/verdict.py)."""
        return judge(version, self.engines.replicas, self.results)

    async def until_usable(self, versions: Iterable[int]) -> tuple[list[FleetVerdict], float]:
        """Waits until every one of `versions` (those a batch's tokens came from) has a usable verdict: a
        replica verified it, or serves it unverified under a policy that accepts that. Returns the
        verdicts, oldest version first, and the seconds waited; past `verify_timeout_seconds` the
        verdicts as they are (the caller acts on them). Version 0 is the base model each replica loads
        from its own files: nothing was transferred, there is nothing to prove."""
        wanted = sorted({v for v in versions if v >= 1})
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.verify_timeout_seconds
        next_ask = started
        while True:
            waiting = [v for v in wanted if not self.verdict(v).usable]
            now = loop.time()
            left = deadline - now
            if waiting and (now >= next_ask or left <= 0):
                # Not heard (a Watch stream that reconnected, a synchronizer restarted since, or a run that
                # started after the report): the synchronizer keeps the last versions' reports. Asked now,
                # again every REASK_REPORTS_SECONDS while the wait lasts, and at its end.
                next_ask = now + REASK_REPORTS_SECONDS
                for version in waiting:
                    await self._ask_reports(version)
            waiting = [v for v in wanted if not self.verdict(v).usable]
            left = deadline - loop.time()
            if not waiting or left <= 0:
                break
            try:
                await asyncio.wait_for(self._reported.wait(), max(0.0, min(left, next_ask - loop.time())))
            except TimeoutError:
                pass
        waited = loop.time() - started
        if wanted:
            self.judged.append(wanted[-1])
            self._waited_since_step += waited
        return [self.verdict(v) for v in wanted], waited

    async def _ask_reports(self, version: int) -> None:
        try:
            records = await self.synchronizer.updates(version)
        except Exception as exc:  # noqa: BLE001 - the Watch stream may still bring them
            log.warning("asking the synchronizer for the reports of version %d failed: %s", version, exc)
            return
        for record in records:
            known = self.results.get(record.version, {}).get(record.component_id)
            if known != record:
                self._record(record)

    def verdicts_json(self) -> list[dict[str, Any]]:
        """The verdicts of the versions train steps were checked for, newest first (the status page)."""
        return [verdict_json(self.verdict(v)) for v in reversed(self.judged)]

    def take_step_metrics(self) -> dict[str, float]:
        """The updates reported since the last call, as step metrics: per phase the slowest and the
        mean replica (update/<phase>_seconds_max|mean), counts, the replicas quarantined now, and the
        verdict on the newest version the step's tokens came from, with each replica's coverage."""
        records = list(self._since_step)
        self._since_step.clear()
        m: dict[str, float] = {
            "update/verified": float(sum(r.outcome == UpdateOutcome.VERIFIED for r in records)),
            "update/failed": float(sum(r.outcome == UpdateOutcome.FAILED for r in records)),
            "update/unverified": float(sum(r.outcome == UpdateOutcome.UNVERIFIED for r in records)),
            "fleet/quarantined": float(sum(r.quarantined for r in self.engines.replicas)),
            "verdict/wait_seconds": self._waited_since_step,
        }
        self._waited_since_step = 0.0
        if self.judged:
            m.update(verdict_metrics(self.verdict(self.judged[-1])))
        for phase in TIMED_PHASES:
            values = [r.timings.by_phase()[phase] for r in records if r.verified]
            if values:
                m[f"update/{phase}_seconds_max"] = max(values)
                m[f"update/{phase}_seconds_mean"] = statistics.fmean(values)
        return m
