"""Following the synchronizer: apply every version it commits, without
waiting for an UpdateWeights call (`synchronizer.follow`).

The follower watches the synchronizer's event stream (reconnecting with
backoff when it breaks; a new stream starts with a snapshot of this rollout,
whose `latest_version` catches up on commits missed meanwhile) and keeps the
newest committed version it has heard of. An applier moves the engine there
through `RolloutCore.update_weights`, the same staged, all-or-nothing path
as UpdateWeights (so the update is reported like any other, see
`services.rollout.presence`): MEMORY versions are pulled from the
synchronizer, CHECKPOINT versions loaded from the path the event names.
Updates coalesce: versions committed while one update runs are skipped
for the newest.

Sync policy: the synchronizer's NeedSync answers by *steps* (for a rollout,
batches produced), which only the controller counts; the rollout service
has no step of its own, so a following rollout applies every committed
version (coalesced) and the policy's schedule is the trainer's: it decides
when a version is committed at all. Leave `follow` off where a controller
drives updates with UpdateWeights: two updaters would race for the same
versions.

A version that fails for a reason a retry cannot fix (weights that do not
fit the model, corrupt bytes, a version the synchronizer no longer holds, an
NCCL version, which cannot be pulled) is not tried again; the next commit is.
Transient failures (synchronizer unreachable, deadline, abort) are retried
with backoff.
"""

from __future__ import annotations

import asyncio
import logging

from flywheel.errors import FailedPrecondition, NotFound
from flywheel.runtime.backoff import Backoff
from services.rollout.config import RolloutConfig
from services.rollout.core import RolloutCore
from services.rollout.sources import Stage, checkpoint_stage, memory_stage
from services.synchronizer.client import SynchronizerClient
from services.synchronizer.client_types import WatchEvent
from services.synchronizer.types import EventKind, Method

log = logging.getLogger(__name__)

#: Failures worth trying the same version again for.
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED"})


class Follower:
    def __init__(
        self, client: SynchronizerClient, core: RolloutCore, config: RolloutConfig, component_id: str,
        *, token: str | None,
    ) -> None:
        self.client, self.core, self.config = client, core, config
        self.component_id, self.token = component_id, token
        #: Newest committed version heard of.
        self.latest = 0
        #: version -> (method, checkpoint path) of committed versions heard of.
        self.sources: dict[int, tuple[Method | None, str]] = {}
        #: Versions that failed for good.
        self.given_up: set[int] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        link = config.synchronizer
        self._backoff = lambda: Backoff(link.retry_initial_seconds, link.retry_max_seconds)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._watch_loop()), asyncio.ensure_future(self._apply_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # -- hearing of versions --------------------------------------------------

    async def _watch_loop(self) -> None:
        backoff = self._backoff()
        while True:
            try:
                async for event in self.client.watch([self.component_id], send_initial=True):
                    backoff.reset()
                    self.learn(event)
                continue  # the stream reached its deadline cleanly: watch again at once
            except Exception as exc:  # noqa: BLE001 - a broken stream is retried, never fatal to the rollout
                log.warning("watching the synchronizer failed; reconnecting",
                            extra={"id": self.component_id, "error": str(exc), "retry_seconds": backoff.delay})
            await backoff.wait()

    def learn(self, event: WatchEvent) -> None:
        latest = event.latest_version
        if event.kind == EventKind.VERSION_COMMITTED and event.version:
            self.sources[event.version] = (event.method, event.location)
            latest = max(latest, event.version)
        if latest > self.latest:
            self.latest = latest
            self._wake.set()

    # -- applying them --------------------------------------------------------

    async def _apply_loop(self) -> None:
        backoff = self._backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (target := self.latest) > self.core.status().version and target not in self.given_up:
                try:
                    await self.apply(target)
                    backoff.reset()
                except Exception as exc:  # noqa: BLE001 - any failure leaves the old version serving; go on
                    if self.core.status().version >= target:
                        continue  # someone else (UpdateWeights) got there first
                    if getattr(exc, "code", "") in TRANSIENT:
                        log.warning("following version failed; retrying",
                                    extra={"version": target, "error": str(exc), "retry_seconds": backoff.delay})
                        await backoff.wait()
                        continue
                    log.warning("following version failed; waiting for a newer one",
                                extra={"version": target, "error": str(exc)})
                    self.given_up.add(target)

    async def apply(self, version: int) -> None:
        stage = await self._stage_for(version)
        outcome = await self.core.update_weights(version, stage, None, None)
        log.info("followed the synchronizer to a new version",
                 extra={"version": outcome.version, "pause_seconds": round(outcome.pause_seconds, 4)})

    async def _stage_for(self, version: int) -> Stage:
        if version not in self.sources:
            # Heard of only through an event's latest_version (a commit while
            # the stream was down): the synchronizer's status names its source.
            status = await self.client.status()
            for info in status.versions:
                self.sources.setdefault(info.version, (info.method, info.path))
        if version not in self.sources:
            raise NotFound(f"the synchronizer no longer lists version {version}")
        method, location = self.sources[version]
        engine, _ = self.core.require_engine()
        specs = engine.weight_specs()
        if method == Method.MEMORY:
            server = self.config.server
            return memory_stage(self.client.address, version, specs, token=self.token,
                                timeout=self.config.updates.timeout_seconds, max_message_bytes=server.max_message_bytes,
                                buffers=self.core.staging)
        if method == Method.CHECKPOINT and location:
            return checkpoint_stage(location, version, specs)
        name = method.name if method else "an unknown method"
        raise FailedPrecondition(f"version {version} travels by {name}, which a rollout cannot pull by itself")
