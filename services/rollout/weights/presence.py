"""The rollout as a component of the synchronizer: its presence there
(registration, heartbeats, deregistration: `flywheel.synchronizer.presence`)
plus reports of weight updates.

The rollout registers with role rollout and its served weight version, and
heartbeats with its step (run steps served, `services.rollout.weights.follower`) and
that version.

Every weight update the core commits or fails, whoever asked for it (an
operator's UpdateWeights, or the follower), is reported twice:
- as state: committed, the new version (a heartbeat carries it; a rollout
  that was asked to sync, REQUIRE_SYNC, goes back to RUNNING with it);
  failed, aborted or timed out, SetState with the version still served and
  the reason, which watchers see as the message of a STATE_CHANGED event. A
  rollout in an NCCL transfer (WAITING_SYNC) keeps its state: the transfer's
  outcome is ReportTransfer's to decide, not ours;
- as a fleet-update result (ReportUpdate): the phase durations, the identity
  computed from what was measured on the resident weights, the coverage (what
  was measured, and how) and the outcome (VERIFIED, UNVERIFIED or FAILED).
  The synchronizer judges it against the identity it recorded and
  quarantines the rollout unless it verified, until one does.

A report the synchronizer could not take (it is down, or restarting and has
not recorded the version yet) is sent again with backoff until it is taken or
a newer report supersedes it, for at most REPORT_RETRY_SECONDS. And the proof
of the version served (its last VERIFIED report) is sent again whenever the
synchronizer forgot this replica and it registered again: the restarted
synchronizer's ledger is empty, and a train step waits for a replica's proof
of the versions its tokens came from (the controller's `Fleet.until_usable`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from flywheel.errors import Aborted, DeadlineExceeded, FailedPrecondition, FlywheelError, NotFound, Unavailable
from flywheel.runtime.backoff import Backoff
from flywheel.synchronizer.client import SynchronizerClient
from services.rollout.config import SynchronizerLinkConfig
from services.rollout.weights.transaction import UpdateReport, WeightUpdates
from flywheel.synchronizer.presence import Presence
from flywheel.synchronizer.types import Method, Role, State, UpdateOutcome, UpdatePhase, UpdateRecord

log = logging.getLogger(__name__)

#: Ways this rollout can receive a version (UpdateWeights: memory, checkpoint, nccl/gloo groups).
CAPABILITIES = (Method.MEMORY, Method.CHECKPOINT, Method.NCCL)

#: Refusals a report outlives by being sent again: the synchronizer is down or slow, or it restarted and
#: has not recorded the version yet (the controller has the trainer publish it again).
TRANSIENT = (Unavailable, DeadlineExceeded, Aborted, FailedPrecondition)

#: How long a report is sent again before it is given up (a version that is never recorded again).
REPORT_RETRY_SECONDS = 300.0

#: The longest wait between two sends of a report: a train step may be waiting for it.
REPORT_RETRY_MAX_SECONDS = 5.0


def describe_failure(report: UpdateReport) -> str:
    error = report.error
    if isinstance(error, asyncio.CancelledError):
        why = "cancelled (the caller gave up or the rollout is stopping)"
    else:
        why = f"{getattr(error, 'code', type(error).__name__)}: {error}"
    if report.unverified:
        return f"weight update to version {report.version} was not proven; the weights held are not trusted: {why}"
    if report.failed_phase in (UpdatePhase.APPLY, UpdatePhase.VERIFY):
        # The engine was loading: what it holds is not a version (quarantined, refusing work).
        return (f"weight update to version {report.version} failed in {report.failed_phase.name.lower()}; "
                f"the weights held are not trusted: {why}")
    return f"weight update to version {report.version} failed; still serving version {report.served}: {why}"


class RolloutPresence(Presence):
    def __init__(
        self,
        client: SynchronizerClient,
        updates: WeightUpdates,
        link: SynchronizerLinkConfig,
        component_id: str,
        address: str,
        labels: Mapping[str, str] | None = None,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        super().__init__(
            client, Role.ROLLOUT, component_id, address, link, lambda: (step(), self.served()),
            capabilities=CAPABILITIES, labels=labels, identity=lambda: self.updates.identity,
        )
        self.updates = updates
        self.core = updates.core
        self._reports: asyncio.Queue[UpdateReport] = asyncio.Queue()
        self._observer = self._reports.put_nowait
        #: The last update that verified: the proof of the version served, told again to a synchronizer
        #: that forgot this replica (`registered_again`).
        self._proof: UpdateReport | None = None

    def served(self) -> int:
        return self.core.status().version

    def start(self) -> None:
        self.updates.observers.append(self._observer)
        super().start()
        self._tasks.append(asyncio.ensure_future(self._report_loop()))

    async def stop(self) -> None:
        """Stops reporting, beating, then deregisters (within the RPC deadline)."""
        if self._observer in self.updates.observers:
            self.updates.observers.remove(self._observer)
        await super().stop()

    def registered_again(self) -> None:
        proof = self._proof
        if proof is not None and proof.version == self.served() and not self.core.quarantine_reason:
            log.info("telling the synchronizer again which version this replica proved",
                     extra={"id": self.component_id, "version": proof.version})
            self._reports.put_nowait(proof)

    async def _report_loop(self) -> None:
        while True:
            report = await self._reports.get()
            # Before the first registration there is nobody to tell: the
            # registration carries whatever version is served by then.
            if not self.registered.is_set():
                continue
            await self._deliver(report)

    async def _deliver(self, report: UpdateReport) -> None:
        """Sends `report` until the synchronizer takes it, a newer report waits, or REPORT_RETRY_SECONDS pass."""
        backoff = Backoff(self.config.retry_initial_seconds, min(self.config.retry_max_seconds, REPORT_RETRY_MAX_SECONDS))
        give_up = asyncio.get_running_loop().time() + REPORT_RETRY_SECONDS
        while True:
            try:
                await self.report(report)
                if report.error is None:
                    self._proof = report
                return
            except FlywheelError as exc:
                again = (isinstance(exc, TRANSIENT) and self._reports.empty()
                         and asyncio.get_running_loop().time() + backoff.delay < give_up)
                # Given up, the next heartbeat still carries the served version.
                log.warning("could not report a weight update to the synchronizer" + ("; sending it again" if again else ""),
                            extra={"id": self.component_id, "version": report.version, "error": str(exc)})
                if not again:
                    return
                await backoff.wait()

    async def report(self, report: UpdateReport) -> None:
        state = await self._current_state(report.served)
        reason = describe_failure(report) if report.error is not None else ""
        # A rollout asked to sync (REQUIRE_SYNC) is done either way: it holds
        # the version now, or the policy asks it again at its next step.
        target = State.RUNNING if state == State.REQUIRE_SYNC else state
        if target != state or reason:
            await self.client.set_state(
                self.component_id, target, expected=state, weight_version=report.served, reason=reason,
                weight_identity=report.resident_identity if report.error is None else b"",
            )
        outcome = (UpdateOutcome.VERIFIED if report.error is None
                   else UpdateOutcome.UNVERIFIED if report.unverified else UpdateOutcome.FAILED)
        record = await self.client.report_update(UpdateRecord(
            self.component_id, report.version, outcome,
            resident_identity=report.resident_identity, failed_phase=report.failed_phase,
            reason=describe_failure(report) if report.error is not None else "", timings=report.timings,
            served_version=report.served, coverage=report.coverage,
        ))
        if not record.verified and report.error is None:
            log.error("the synchronizer did not accept this update as verified",
                      extra={"id": self.component_id, "version": report.version, "reason": record.reason})

    async def _current_state(self, served: int) -> State:
        """Heartbeats with `served` (registering again if forgotten); the state the synchronizer holds."""
        try:
            beat = await self.client.heartbeat(self.component_id, self.progress()[0], served)
            if beat.state != State.STOPPED:
                return beat.state
        except NotFound:
            pass
        await self.client.reregister(self.component_id, weight_version=served)
        self.registered_again()
        return State.RUNNING
