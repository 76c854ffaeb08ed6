"""The weight-sync controller: how the run's weights reach the rollouts.

With a synchronizer (`governed`), the controller moves no bytes. It hands the
synchronizer the run's policy at start: style, interval, offset, method and,
from the mode, what a replica waits for before it generates for a run step
(sync: the version due at its step; batch-async: to be at most
`staleness.threshold` behind; fully-async: nothing). The trainer then
publishes every due version itself and each replica follows the policy by its
own steps (services/trainer/publisher.py, services/rollout/weights/follower.py).
What remains here: the staleness gate paces dispatch on the trainer's
version, and a version the run must measure outside the schedule (the start
of a run or a resume, validation) is published once if the synchronizer does
not hold it yet; the replicas then move because the requests that need it
name it (`min_weight_version`).

Without a synchronizer (standalone), the controller choreographs every move
itself, as below. When: `SyncPolicy` applies the FIXED rule locally: after
step s when s > offset and (s - offset) % interval == 0. Whatever the policy
says, weights move when not moving them would stall the run (sync mode: every
step; batch-async: before rollouts fall more than the staleness threshold
behind).

How: the trainer writes a safetensors directory (ExportWeights) and every
replica loads it (UpdateWeights). MEMORY and NCCL need a synchronizer, which
then governs (the run config checks).

Per mode:
- sync: rollouts are paused, in-flight ones drain (quiescence), every
  healthy replica moves to the new version, then rollouts resume: all
  generation after the step is on the newest weights;
- fully-async / batch-async: the trainer's export is awaited (it is the
  trainer's time either way), replicas load in the background and nobody
  waits; in-flight requests follow `pause_mode` (keep: continue on the new
  weights after the swap; wait: finish first; abort: return ABORT and are
  retried). Updates coalesce: a replica behind by several versions jumps to
  the newest.

After every replica update the staleness gate learns the oldest version a
healthy replica serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.controller.activity import ActivityTracker
from services.controller.balancer import EnginePool, Replica
from services.controller.domain import TrainResult, WeightSource
from services.controller.errors_report import ErrorReporter
from services.controller.protocols import Synchronizer, Trainer
from services.controller.staleness import StalenessGate

log = logging.getLogger(__name__)


class SyncPolicy:
    def __init__(self, interval: int = 1, offset: int = 0) -> None:
        self.interval, self.offset = interval, offset

    def need(self, step: int) -> bool:
        return step > self.offset and (step - self.offset) % self.interval == 0


class WeightSyncController:
    def __init__(
        self,
        trainer: Trainer,
        engines: EnginePool,
        gate: StalenessGate,
        tracker: ActivityTracker,
        errors: ErrorReporter,
        *,
        mode: str,
        method: str,
        style: str = "fixed",
        pause_mode: str = "keep",
        timeout_seconds: float = 120.0,
        checkpoint_dir: str = "",
        synchronizer: Synchronizer | None = None,
        synchronizer_address: str = "",
        policy: SyncPolicy | None = None,
        pause_rollouts: Callable[[], None] = lambda: None,
        resume_rollouts: Callable[[], None] = lambda: None,
    ) -> None:
        self.trainer, self.engines, self.gate, self.tracker, self.errors = trainer, engines, gate, tracker, errors
        self.mode, self.method, self.style, self.pause_mode = mode, method, style, pause_mode
        self.timeout_seconds, self.checkpoint_dir = timeout_seconds, checkpoint_dir
        self.synchronizer, self.synchronizer_address = synchronizer, synchronizer_address
        self.policy = policy or SyncPolicy()
        self.pause_rollouts, self.resume_rollouts = pause_rollouts, resume_rollouts
        self.published: tuple[int, WeightSource] | None = None
        self.transfers = 0
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()  # the background updater has nothing left to do
        self._idle.set()
        self._updater: asyncio.Task | None = None
        # One update at a time per replica: the background updater and a
        # blocking transfer must not both push to one replica (the second
        # would be refused as "not newer" and cost the replica its place).
        self._replica_locks: dict[str, asyncio.Lock] = {}

    # -- the verbs the main loop uses ----------------------------------------
    @property
    def governed(self) -> bool:
        """A synchronizer owns the weight plane: the trainer publishes, replicas follow, this observes."""
        return self.synchronizer is not None

    async def configure(self) -> None:
        """Hands the run's policy to the synchronizer (it answers NeedSync by it)."""
        if self.synchronizer is not None:
            await self.synchronizer.configure_policy(
                style=self.style, method=self.method, interval=self.policy.interval, offset=self.policy.offset,
                timeout_seconds=self.timeout_seconds, mode=self.mode, max_staleness=self.gate.limit or 0,
            )

    async def bring_up_to(self, version: int) -> None:
        """Blocking: every healthy replica on `version` (start of a run, resume). Governed: the
        version is published; replicas reach it at their first step's sync or the first request naming it."""
        if self.governed:
            await self.publish(version)
            self.gate.set_rollout_version(version)
            return
        await self.engines.refresh_versions()
        if all(r.version >= version for r in self.engines.healthy()):
            self.gate.set_rollout_version(self.engines.min_version())
            return
        await self._transfer(version, pause_mode="wait")

    async def settle(self, version: int) -> None:
        """Returns once every healthy replica serves `version` or newer.

        Validation and the end of a run measure the weights they name: the
        background updater is let finish, then any replica still behind is
        moved (waiting for its in-flight requests). Governed: `version` is
        published; the validation requests name it as their minimum."""
        if self.governed:
            await self.publish(version)
            return
        if self._updater is not None and not self._updater.done():
            await self._idle.wait()
        await self._transfer(version, pause_mode="wait")

    async def after_step(self, result: TrainResult) -> None:
        if self.governed:
            # The trainer published whatever was due before its step answered;
            # replicas follow on their own. The next batch may now be dispatched.
            self.gate.set_rollout_version(result.version)
            return
        need = self.policy.need(result.step)
        if not need and not self._overdue(result.version):
            return
        if self.mode == "sync":
            self.pause_rollouts()
            try:
                await self.tracker.wait_quiescent("rollout")
                await self._transfer(result.version, pause_mode="wait")
            finally:
                self.resume_rollouts()
        else:
            self.published = (result.version, await self._export(result.version))
            self._start_updater()
            self._wake_updater()

    async def close(self) -> None:
        if self._updater is not None:
            self._updater.cancel()
            await asyncio.gather(self._updater, return_exceptions=True)

    # -- how -----------------------------------------------------------------
    def _overdue(self, version: int) -> bool:
        """Whether waiting for the policy's next sync would stall the run: with a
        staleness bound, rollouts on weights more than `limit` versions old can
        fill no further batch. Sync mode (bound 0) is always overdue."""
        if self.gate.limit is None:
            return False
        newest = max(self.engines.min_version(), self.published[0] if self.published else 0)
        return version - newest > self.gate.limit

    async def publish(self, version: int, *, again: bool = False) -> None:
        """Governed: the synchronizer holds `version` (the trainer's current) once this returns.

        For versions the policy did not make due: the trainer publishes them
        itself at its steps, and NeedSync refuses nothing published twice.
        `again` (after a rewind, replicas going back to `version`): an NCCL
        version is broadcast although the synchronizer lists it, since
        nobody can pull it."""
        assert self.synchronizer is not None
        if version < 1:
            return  # version 0 is the base model every replica loads
        if await self.synchronizer.latest_version() >= version and not (again and self.method == "nccl"):
            return
        if self.method == "nccl":
            # Every registered replica joins the group on its own (it watches the synchronizer).
            group = await self.synchronizer.allocate_group(version, [], self.timeout_seconds)
            with self.tracker.track("trainer", f"broadcast v{version}"):
                await asyncio.wait_for(self.trainer.export_weights(WeightSource("nccl", group=group)),
                                       self.timeout_seconds)
        else:
            await self._export(version)
        self.transfers += 1

    async def _export(self, version: int) -> WeightSource:
        # With a synchronizer, the trainer registers CHECKPOINT versions itself.
        target = WeightSource(self.method, synchronizer_address=self.synchronizer_address, path=self.checkpoint_dir)
        with self.tracker.track("trainer", f"export v{version}"):
            return await asyncio.wait_for(self.trainer.export_weights(target), self.timeout_seconds)

    async def _transfer(self, version: int, *, pause_mode: str) -> None:
        """Trainer -> every healthy replica behind `version`, awaited."""
        behind = [r for r in self.engines.healthy() if r.version < version]
        exported = self.published is not None and self.published[0] == version
        if not behind:
            if len(self.engines.healthy()) < len(self.engines) and not exported:
                # A replica that is down misses this version: kept as published, it is what
                # replica_recovered brings it to (else sync mode's gate would wait for it forever).
                self.published = (version, await self._export(version))
            return
        source = self.published[1] if exported else await self._export(version)  # type: ignore[index]
        await asyncio.gather(*(self._update(r, version, source, pause_mode) for r in behind))
        self.published = (version, source)
        self._after_updates(version)

    async def _update(self, replica: Replica, version: int, source: WeightSource, pause_mode: str) -> None:
        lock = self._replica_locks.setdefault(replica.name, asyncio.Lock())
        try:
            async with lock:
                if replica.version >= version:
                    return  # another update got there while this one waited
                with self.tracker.track("weight_sync", replica.name):
                    served = await asyncio.wait_for(
                        replica.engine.update_weights(version, source, pause_mode=pause_mode), self.timeout_seconds
                    )
                self.engines.set_version(replica.name, served)
                self.transfers += 1
        except Exception as exc:
            # The replica keeps serving its old version, so it leaves the pool
            # until the next successful update instead of producing stale data.
            self.engines.mark(replica.name, False, f"weight update failed: {exc}")
            severity = "critical" if not self.engines.healthy() else "error"
            self.errors.report("weight_sync", exc, severity=severity, context={"replica": replica.name, "version": version})

    def _after_updates(self, version: int) -> None:
        self.gate.set_rollout_version(self.engines.min_version())

    def _start_updater(self) -> None:
        if self._updater is None or self._updater.done():
            self._updater = asyncio.ensure_future(self._update_loop())

    def _wake_updater(self) -> None:
        self._idle.clear()
        self._kick.set()

    async def _update_loop(self) -> None:
        try:
            while True:
                await self._kick.wait()
                self._kick.clear()
                assert self.published is not None
                version, source = self.published
                behind = [r for r in self.engines.healthy() if r.version < version]
                await asyncio.gather(*(self._update(r, version, source, self.pause_mode) for r in behind))
                self._after_updates(version)
                if not self._kick.is_set():
                    self._idle.set()
        finally:
            self._idle.set()  # a cancelled updater must not leave `settle` waiting

    def replica_recovered(self, name: str) -> None:
        """A replica came back: bring it to the newest version before it serves."""
        if self.published is not None and self.engines.replica(name).version < self.published[0]:
            self._start_updater()
            self._wake_updater()
