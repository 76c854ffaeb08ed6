"""The rollout replica as the synchronizer's follower: it moves its weights
only when the synchronizer's policy says so.

A replica's *step* is one run step it served: a generation request tagged
`run_step = r` (the train batch it is for, from 1) means the replica has
completed r - 1 steps. The first request of a new step makes the follower ask
`NeedSync(id, r - 1)`; when the policy says sync (FIXED at its points,
DYNAMIC_BY_EXPLORER every `interval` steps) the synchronizer moves the replica
to REQUIRE_SYNC and names the version, the follower fetches it (MEMORY: pulled
from the synchronizer once committed; CHECKPOINT: loaded from the path the
commit names) and installs it through the one door every update takes
(`services.rollout.weights.arrival`), as an operator's UpdateWeights does. The presence reports the outcome, which
takes the replica back to RUNNING. A DYNAMIC request whose wait lapses is
asked again at the next step.

Before a request of step r generates, the policy's `rollout_wait` decides
what it waits for:
- DUE_VERSION (sync mode): the version NeedSync named for step r - 1;
- STALENESS (batch-async): until the replica is at most `max_staleness`
  versions behind r - 1;
- NONE (fully-async): nothing; the sync runs in the background.
A request may also name `min_weight_version` (validation measures the weights
it names). A wait that outlasts the policy's timeout fails the request with
ABORTED (retry later); nothing half-applied is ever served.

A rewind (the trainer died and resumed from its checkpoint at version N; N = 0:
it had none, and the run starts over from the base model) is the one way down: the synchronizer drops every version above N and starts a
new lineage (its epoch, on every Watch event). A replica serving a version
above N forgets what it heard of the old lineage, holds its generations back,
and installs the new lineage's newest version once there is one (N, which the
controller has the trainer publish again; by NCCL, the synchronizer puts the
replica in its broadcast although its number is higher; version 0, the base
model, is reloaded from the engine's own model directory) with
a rewinding install;
its next report (at or below N) is what the synchronizer takes as its way
back. A replica that missed the REWOUND event sees the new epoch on the next
event it gets (a reconnecting Watch sends one at once).

At registration a replica catches up to the newest committed version before
it reports SERVING, so a replica that joins mid-run (scale-out, a restart)
never generates on its base weights: it pulls a MEMORY or CHECKPOINT version,
and waits for an NCCL one, which the trainer broadcasts again to the replicas
behind it (flywheel/synchronizer/policy.py).

Every update (whatever started it) runs the core's phases (admit under the
policy's pause mode, transfer, apply, verify, reopen) and is reported to the
synchronizer with its timings and the identity measured on the resident
weights (services.rollout.weights.presence). A replica whose update failed
is quarantined by the synchronizer (no traffic, so no steps to sync at): it
goes on installing the newest committed version, with backoff, until an
update verifies. A replica that registered holding a lost lineage's weights
under a current number (the same version, another identity) is quarantined
too, and installs the run's version in their place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from flywheel.common.types import PauseMode
from flywheel.errors import Aborted, FailedPrecondition, NotFound
from flywheel.runtime.backoff import Backoff
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.policy import required_version
from flywheel.synchronizer.types import EventKind, GroupInfo, Method, Policy
from services.rollout.config import RolloutConfig
from services.rollout.weights.arrival import FromBaseModel, FromCheckpoint, FromGroup, FromSynchronizer, Source, WeightArrival
from services.rollout.weights.nccl import NcclTarget

log = logging.getLogger(__name__)

#: Failures worth trying the same version again for.
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED"})


def _notify(owner: object, name: str) -> None:
    """Wakes everyone waiting on the event `owner.<name>`, which is replaced by a fresh one."""
    event = getattr(owner, name)
    setattr(owner, name, asyncio.Event())
    event.set()


class Follower:
    def __init__(self, client: SynchronizerClient, arrival: WeightArrival, config: RolloutConfig,
                 component_id: str) -> None:
        self.client, self.arrival, self.config = client, arrival, config
        self.core = arrival.updates.core
        self.component_id = component_id
        #: Steps this replica completed (the newest run_step seen, minus one).
        self.step = 0
        #: step -> the version NeedSync named for it (0: none due).
        self.due: dict[int, int] = {}
        self.policy: Policy | None = None
        #: Newest committed version heard of.
        self.latest = 0
        #: version -> (method, checkpoint path) of committed versions heard of.
        self.sources: dict[int, tuple[Method | None, str]] = {}
        #: The synchronizer quarantined this replica (its last update failed, or it holds a lost
        #: lineage's weights): it installs the newest version until an update verifies.
        self.quarantined = False
        #: The version the sync loop moves towards (at least).
        self.target = 0
        #: The synchronizer's lineage (rewinds so far) as last heard.
        self.epoch = 0
        #: A rewind to this version is under way: the served weights are of a lost lineage.
        self.rewind_to: int | None = None
        self._asked: dict[int, asyncio.Future] = {}
        self._heard = asyncio.Event()  # self.latest moved
        self._moved = asyncio.Event()  # the served version moved (or a sync attempt ended)
        self._wake = asyncio.Event()  # self.target moved
        self._tasks: list[asyncio.Task] = []
        self._joins: list[asyncio.Task] = []
        link = config.synchronizer
        self._backoff = lambda: Backoff(link.retry_initial_seconds, link.retry_max_seconds)

    @property
    def served(self) -> int:
        return self.core.status().version

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._watch_loop()), asyncio.ensure_future(self._sync_loop())]

    async def stop(self) -> None:
        for task in (*self._tasks, *self._joins):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._joins, return_exceptions=True)
        self._tasks, self._joins = [], []

    # -- the generation gate ----------------------------------------------------

    async def before_generate(self, run_step: int, min_version: int) -> None:
        """Waits until a generation of `run_step` may run on the served weights."""
        if self.rewind_to is not None:
            await self._rewound(self._timeout())
        due = 0
        if run_step > 0:
            due = await self._reached_step(run_step - 1)
        need = max(min_version, required_version(self.policy, run_step, due))
        if need > self.served:
            await self.reach(need, self._timeout())

    async def _reached_step(self, step: int) -> int:
        """Asks NeedSync once per new step; the version due at `step` (0: none)."""
        if step > self.step or (step == self.step and step not in self._asked and step > 0):
            self.step = step
            self._asked[step] = asyncio.ensure_future(self._need_sync(step))
            for old in [s for s in self._asked if s < step - 8]:
                # Requests of a long-gone step find no due version: they wait for nothing.
                self._asked.pop(old)
                self.due.pop(old, None)
        future = self._asked.get(step)
        if future is not None:
            await asyncio.shield(future)
        return self.due.get(step, 0)

    async def _need_sync(self, step: int) -> None:
        try:
            decision = await self.client.need_sync(self.component_id, step)
        except Exception as exc:  # noqa: BLE001 - unreachable synchronizer: serve on, ask at the next step
            log.warning("NeedSync failed; serving on", extra={"id": self.component_id, "step": step, "error": str(exc)})
            return
        if decision.policy is not None:
            self.policy = decision.policy
        self._hear(decision.latest_version)
        if decision.need_sync:
            self.due[step] = decision.version
            log.info("sync required", extra={"id": self.component_id, "step": step, "version": decision.version})
            self._aim(decision.version)

    def _timeout(self) -> float:
        return self.policy.timeout_seconds if self.policy is not None else self.config.updates.timeout_seconds

    async def reach(self, version: int, timeout: float) -> None:
        """Returns once the served version is at least `version`; Aborted after `timeout` seconds."""
        self._aim(version)
        await self._served_at_least(version, timeout)

    async def _served_at_least(self, version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.served < version:
            left = deadline - time.monotonic()
            if left <= 0:
                # ABORTED, not UNAVAILABLE: the replica is healthy; the caller retries the work later.
                raise Aborted(
                    f"rollout {self.component_id} still serves version {self.served}; this generation needs "
                    f"version {version} and it did not arrive within {timeout:g} s"
                )
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except TimeoutError:
                pass

    async def _rewound(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (to := self.rewind_to) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Aborted(
                    f"rollout {self.component_id} serves version {self.served} of weights the run was rewound past "
                    f"(to version {to}); the new lineage's version did not arrive within {timeout:g} s")
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except TimeoutError:
                pass

    def _aim(self, version: int) -> None:
        if version > self.target:
            self.target = version
            self._wake.set()

    # -- hearing of versions ----------------------------------------------------

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
        if event.kind == EventKind.REWOUND or event.epoch != self.epoch:
            self.epoch = event.epoch
            if event.kind == EventKind.REWOUND or event.epoch > 0:
                self.rewind(event.version if event.kind == EventKind.REWOUND else event.rewound_to,
                            event.latest_version)
        group = event.group
        if event.kind == EventKind.TRANSFER_STARTED and group is not None and group.ranks.get(self.component_id, 0) > 0:
            self._joins.append(asyncio.ensure_future(self._join(group)))
            self._joins = [t for t in self._joins if not t.done()]
        latest = event.latest_version
        if event.kind == EventKind.VERSION_COMMITTED and event.version:
            self.sources[event.version] = (event.method, event.location)
            latest = max(latest, event.version)
        c = event.component
        if c is not None and c.id == self.component_id and c.quarantined != self.quarantined:
            self.quarantined = c.quarantined
            if c.quarantined:
                log.warning("quarantined by the synchronizer; installing the newest version until one verifies",
                            extra={"id": self.component_id, "reason": c.quarantine_reason})
                self._wake.set()
        self._hear(latest)
        if self._reinstall_due():
            self._wake.set()  # a newer version to try while quarantined

    def rewind(self, to_version: int, latest: int) -> None:
        """The synchronizer went back to `to_version` (newest committed now: `latest`): what was
        heard above it is gone, the steps after it are served again, and weights newer than it
        are replaced by the new lineage's."""
        self.latest = latest
        self.sources = {v: s for v, s in self.sources.items() if v <= to_version}
        self.target = min(self.target, to_version)
        self.step = min(self.step, to_version)
        for step in [s for s in self._asked if s >= to_version]:
            self._asked.pop(step)
        self.due = {s: v for s, v in self.due.items() if s < to_version and v <= to_version}
        if self.served > to_version:
            log.warning("the run's weights were rewound; replacing the served ones",
                        extra={"id": self.component_id, "serving": self.served, "to_version": to_version,
                               "epoch": self.epoch})
            self.rewind_to = to_version
            self._wake.set()
        _notify(self, "_heard")

    def _hear(self, latest: int) -> None:
        if latest > self.latest:
            self.latest = latest
            _notify(self, "_heard")

    async def catch_up(self, timeout: float) -> None:
        """At registration: move to the newest committed version, if newer than the served one."""
        try:
            status = await self.client.status()
        except Exception as exc:  # noqa: BLE001 - registration goes on; the first step syncs
            log.warning("could not read the synchronizer's versions to catch up", extra={"error": str(exc)})
            return
        self.policy = status.policy
        self.epoch = status.epoch
        for info in status.versions:
            self.sources.setdefault(info.version, (info.method, info.path))
        me = status.component(self.component_id)
        if me is not None and me.quarantined:
            # It holds weights the run does not know under their number (a lineage a rewind abandoned).
            self.quarantined = True
            log.warning("registered quarantined; installing the run's newest version",
                        extra={"id": self.component_id, "reason": me.quarantine_reason})
            self._wake.set()
        self._hear(status.latest_version)
        latest = status.latest_version
        if latest <= self.served:
            return
        method = self.sources.get(latest, (None, ""))[0]
        if not self._source_known(latest) and method != Method.NCCL:
            return
        log.info("catching up to the synchronizer's newest version",
                 extra={"id": self.component_id, "serving": self.served, "version": latest,
                        "method": method.name.lower() if method else "unknown"})
        try:
            if method == Method.NCCL:
                # Nothing to pull: registering behind it made the synchronizer ask
                # the trainer to broadcast it again, and this replica joins (learn).
                await self._served_at_least(latest, timeout)
            else:
                await self.reach(latest, timeout)
        except Aborted as exc:
            log.warning("catching up failed; the first step syncs again", extra={"error": str(exc)})

    def _source_known(self, version: int) -> bool:
        method, path = self.sources.get(version, (None, ""))
        return method == Method.MEMORY or (method == Method.CHECKPOINT and bool(path))

    # -- applying them ----------------------------------------------------------

    async def _sync_loop(self) -> None:
        backoff = self._backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.rewind_to is not None or self.target > self.served or self._reinstall_due():
                tried = 0
                try:
                    if self.rewind_to is not None:
                        await self._go_back()
                    elif self.target > self.served:
                        tried = await self._committed_at_least(self.target)
                        await self.apply(tried)
                    else:
                        tried = self.latest
                        await self.apply(tried, reinstall=True)
                    backoff.reset()
                except Exception as exc:  # noqa: BLE001 - any failure leaves the old version serving; go on
                    if tried and getattr(exc, "code", "") == NotFound.code and await self._superseded(tried):
                        # A newer push evicted it before it was pulled (keep_versions): the newest now.
                        log.info("version evicted before it was pulled; going for the newest",
                                 extra={"id": self.component_id, "version": tried, "latest": self.latest})
                        continue
                    if getattr(exc, "code", "") not in TRANSIENT and self.rewind_to is None and not self._reinstall_due():
                        log.warning("sync failed; waiting for the next request",
                                    extra={"id": self.component_id, "target": self.target, "error": str(exc)})
                        self.target = self.served  # the next step (or generation) aims again
                        break
                    log.warning("sync failed; retrying", extra={"id": self.component_id, "target": self.target,
                                                                 "error": str(exc), "retry_seconds": backoff.delay})
                    await backoff.wait()
                finally:
                    _notify(self, "_moved")

    async def _superseded(self, version: int, wait: float = 5.0) -> bool:
        """Whether a version newer than `version` is committed (heard on Watch within `wait` s:
        the push that evicted `version` is announced right after it)."""
        deadline = time.monotonic() + wait
        while self.latest <= version and self.rewind_to is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._heard.wait(), left)
        return self.latest > version

    async def _join(self, group: GroupInfo) -> None:
        """NCCL: receives the trainer's broadcast in a group the synchronizer put this replica in."""
        target = NcclTarget(group.group_id, self.client.address, group.ranks[self.component_id])
        to = self.rewind_to  # a group after a rewind carries the new lineage's version, whatever its number
        try:
            await self.arrival.install(group.version, FromGroup(target), mode=self._pause_mode(),
                                       rewind=to is not None or (self._reinstall_due() and group.version <= self.served))
            if to is not None and self.rewind_to == to:  # no newer rewind meanwhile
                self.rewind_to = None
                log.info("rewound", extra={"id": self.component_id, "version": self.served, "epoch": self.epoch})
        except Exception as exc:  # noqa: BLE001 - reported to the synchronizer already; the old version serves on
            log.warning("joining transfer failed", extra={"group": group.group_id, "error": str(exc)})
        finally:
            _notify(self, "_moved")

    async def _committed_at_least(self, version: int) -> int:
        """The newest committed version once it is newer than the served one (a
        step towards `version` is progress: generations waiting for less than
        `version` may run on it), or once it reaches `version` (or a rewind begins)."""
        while self.rewind_to is None and self.latest < version and self.latest <= self.served:
            await self._heard.wait()
        return self.latest

    async def _go_back(self) -> None:
        """A rewind: installs the new lineage's newest version (at least the rewound one, which
        the trainer publishes again) in place of the served weights, however their numbers compare."""
        to = self.rewind_to
        while to is not None and self.latest < to:
            await self._heard.wait()
            to = self.rewind_to
        if to is None:
            return
        version = self.latest
        if version > 0 and (await self._source(version))[0] == Method.NCCL:
            # Nothing to pull: the trainer broadcasts it again with this replica in the group (_join).
            if self.rewind_to == to:
                await self._moved.wait()
            return
        await self.apply(version, rewind=True)
        if self.rewind_to == to:  # no newer rewind meanwhile
            self.rewind_to = None
            log.info("rewound", extra={"id": self.component_id, "version": self.served, "epoch": self.epoch})

    def _reinstall_due(self) -> bool:
        """Quarantined (by the synchronizer, or by its own failed apply or verification): the served
        weights are not trusted, and the newest committed version is installed in their place."""
        return (self.quarantined or bool(self.core.quarantine_reason)) and self.latest >= 1

    def _pause_mode(self) -> PauseMode | None:
        """What the run's policy says to do with in-flight requests while the weights change."""
        mode = self.policy.pause_mode if self.policy is not None else ""
        return mode or None  # type: ignore[return-value]

    async def apply(self, version: int, *, rewind: bool = False, reinstall: bool = False) -> None:
        """Installs `version`. `reinstall` (quarantined): also when its number is the served one's (the
        weights are not trusted); as with `rewind`, the update then takes the same number."""
        if version <= self.served and not (rewind or reinstall):
            return
        result = await self.arrival.install(version, await self._source_for(version), mode=self._pause_mode(),
                                            rewind=rewind or (reinstall and version <= self.served))
        if reinstall:
            self.quarantined = False  # verified; the synchronizer's event confirms it
        log.info("synced to the synchronizer's version",
                 extra={"id": self.component_id, "version": result.version,
                        "pause_seconds": round(result.pause_seconds, 4),
                        "verify_seconds": round(result.timings.verify_seconds, 4)})

    async def _source(self, version: int) -> tuple[Method | None, str]:
        """How `version` travels: its method and checkpoint path."""
        if version not in self.sources:
            # Heard of only through an event's latest_version (a commit while
            # the stream was down): the synchronizer's status names its source.
            status = await self.client.status()
            for info in status.versions:
                self.sources.setdefault(info.version, (info.method, info.path))
        if version not in self.sources:
            raise NotFound(f"the synchronizer no longer lists version {version}")
        return self.sources[version]

    async def _source_for(self, version: int) -> Source:
        if version == 0:  # the run started over (a rewind to 0): the weights this replica started with
            return FromBaseModel()
        method, location = await self._source(version)
        if method == Method.MEMORY:
            return FromSynchronizer()
        if method == Method.CHECKPOINT and location:
            return FromCheckpoint(location)
        name = method.name if method else "an unknown method"
        raise FailedPrecondition(f"version {version} travels by {name}, which a rollout cannot pull by itself")
