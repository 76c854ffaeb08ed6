"""The rollout as a component of the synchronizer: registration, heartbeats,
reports of weight updates, deregistration.

Once the engine is loaded, the rollout registers (role rollout, its id, the
address its gRPC server is reached at, its served weight version) and then
heartbeats at least every lease/3 with that version; a synchronizer that
forgot it (restarted without a store) or expired its lease gets it registered
again (`services.synchronizer.heartbeats`). A synchronizer that cannot be
reached is retried with backoff while the rollout keeps serving: nothing here
ever stops generation or raises into the service.

Every weight update the core commits or fails, whoever asked for it (the
controller's UpdateWeights, or the follower), is reported:
- committed: the new version (a heartbeat carries it; a rollout that was
  asked to sync, REQUIRE_SYNC, goes back to RUNNING with it);
- failed, aborted or timed out: SetState with the version still served and
  the reason, which watchers of the synchronizer see as the message of a
  STATE_CHANGED event. A rollout in an NCCL transfer (WAITING_SYNC) keeps its
  state: the transfer's outcome is ReportTransfer's to decide, not ours.

On graceful shutdown the rollout deregisters, so nobody waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from flywheel.errors import FlywheelError, NotFound
from services.rollout.backoff import Backoff
from services.rollout.config import SynchronizerLinkConfig
from services.rollout.core import RolloutCore, UpdateReport
from services.synchronizer.client import SynchronizerClient
from services.synchronizer.heartbeats import Heartbeats
from services.synchronizer.types import Method, Role, State

log = logging.getLogger(__name__)

#: Ways this rollout can receive a version (NCCL needs a receiver the engine lacks so far).
CAPABILITIES = (Method.MEMORY, Method.CHECKPOINT)


def describe_failure(report: UpdateReport) -> str:
    error = report.error
    if isinstance(error, asyncio.CancelledError):
        why = "cancelled (the caller gave up or the rollout is stopping)"
    else:
        why = f"{getattr(error, 'code', type(error).__name__)}: {error}"
    return f"weight update to version {report.version} failed; still serving version {report.served}: {why}"


class Presence:
    def __init__(
        self,
        client: SynchronizerClient,
        core: RolloutCore,
        link: SynchronizerLinkConfig,
        component_id: str,
        address: str,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.client, self.core, self.link = client, core, link
        self.component_id, self.address = component_id, address
        self.labels = dict(labels or {})
        #: Set once the first registration succeeded.
        self.registered = asyncio.Event()
        self.heartbeats: Heartbeats | None = None
        self._reports: asyncio.Queue[UpdateReport] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._observer = self._reports.put_nowait

    def served(self) -> int:
        return self.core.status().version

    def start(self) -> None:
        self.core.update_observers.append(self._observer)
        self._tasks = [asyncio.ensure_future(self._register()), asyncio.ensure_future(self._report_loop())]

    async def stop(self) -> None:
        """Stops beating and reporting, then deregisters (within the RPC deadline)."""
        if self._observer in self.core.update_observers:
            self.core.update_observers.remove(self._observer)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.heartbeats is not None:
            await self.heartbeats.stop()
        if self.registered.is_set():
            try:
                await self.client.deregister(self.component_id)
                log.info("deregistered from the synchronizer", extra={"id": self.component_id})
            except FlywheelError as exc:
                # Its lease runs out on its own: the synchronizer marks it STOPPED then.
                log.warning("deregistration failed", extra={"id": self.component_id, "error": str(exc)})

    async def _register(self) -> None:
        backoff = Backoff(self.link.retry_initial_seconds, self.link.retry_max_seconds)
        while True:
            try:
                registration = await self.client.register(
                    Role.ROLLOUT, self.component_id, address=self.address, capabilities=CAPABILITIES,
                    labels=self.labels, weight_version=self.served(),
                )
                break
            except FlywheelError as exc:
                # Also for errors a retry cannot fix (a taken id, a wrong token):
                # the rollout serves on and the log says why it is not registered.
                log.warning("registration with the synchronizer failed; retrying",
                            extra={"id": self.component_id, "address": self.client.address, "error": str(exc),
                                   "retry_seconds": backoff.delay})
                await backoff.wait()
        log.info("registered with the synchronizer",
                 extra={"id": self.component_id, "address": self.address, "weight_version": self.served(),
                        "lease_seconds": registration.lease_seconds})
        self.registered.set()
        interval = self.link.heartbeat_interval_seconds or None
        self.heartbeats = self.client.keep_alive(self.component_id, lambda: (0, self.served()), interval=interval)
        self.heartbeats.start()

    async def _report_loop(self) -> None:
        while True:
            report = await self._reports.get()
            # Before the first registration there is nobody to tell: the
            # registration carries whatever version is served by then.
            if not self.registered.is_set():
                continue
            try:
                await self.report(report)
            except FlywheelError as exc:
                # The next heartbeat still carries the served version.
                log.warning("could not report a weight update to the synchronizer",
                            extra={"id": self.component_id, "version": report.version, "error": str(exc)})

    async def report(self, report: UpdateReport) -> None:
        state = await self._current_state(report.served)
        reason = describe_failure(report) if report.error is not None else ""
        # A rollout asked to sync (REQUIRE_SYNC) is done either way: it holds
        # the version now, or the policy asks it again at its next step.
        target = State.RUNNING if state == State.REQUIRE_SYNC else state
        if target != state or reason:
            await self.client.set_state(
                self.component_id, target, expected=state, weight_version=report.served, reason=reason
            )

    async def _current_state(self, served: int) -> State:
        """Heartbeats with `served` (registering again if forgotten); the state the synchronizer holds."""
        try:
            beat = await self.client.heartbeat(self.component_id, 0, served)
            if beat.state != State.STOPPED:
                return beat.state
        except NotFound:
            pass
        await self.client.reregister(self.component_id, weight_version=served)
        return State.RUNNING
