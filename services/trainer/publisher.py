"""The trainer publishes its weight versions when the synchronizer's policy
says so; nobody else moves them.

After every optimizer step (before the step's RPC answers, so a caller that
sees step s also finds version s published if it was due) and whenever the
synchronizer announces that a rollout awaits a version, that it lost the
newest bytes, or that the run needs a version off the schedule
(SYNC_REQUESTED, PUSH_REQUESTED, VERSION_REQUESTED on Watch: the trainer may
be waiting for data then), the publisher asks `NeedSync` as the trainer and,
when due, publishes by the policy's method:
- MEMORY: pushes the version to the synchronizer;
- CHECKPOINT: writes `<publish_dir>/version_N` and registers it;
- NCCL: asks the synchronizer for a group of the rollouts registered at that
  moment and broadcasts as its rank 0.

Publishes are serialized, and NeedSync answers "no" for a version that is out
already, so a version is published once however many wait for it. LoRA
policies publish merged weights (rollouts serve full models).
"""

from __future__ import annotations

import asyncio
import logging

from flywheel.errors import FlywheelError
from flywheel.runtime.backoff import Backoff
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.types import EventKind, Method
from services.trainer.config import TrainerConfig
from services.trainer.export import ExportResult, WeightExporter
from services.trainer.training import TrainingEngine

log = logging.getLogger(__name__)

#: Events after which the trainer asks NeedSync between steps: a rollout awaits a version, the
#: synchronizer lost the newest bytes, or the run needs a version off the schedule.
WAKES = frozenset({EventKind.SYNC_REQUESTED, EventKind.PUSH_REQUESTED, EventKind.VERSION_REQUESTED})


class Publisher:
    def __init__(
        self, client: SynchronizerClient, exporter: WeightExporter, engine: TrainingEngine, config: TrainerConfig
    ) -> None:
        self.client, self.exporter, self.engine, self.config = client, exporter, engine, config
        self.trainer_id = config.sync.trainer_id
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._watch_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def after_step(self) -> bool:
        """Publishes the step's version if the policy makes it due; never raises
        (a failed publish is logged, and asked again at the next step). False: it failed."""
        try:
            await self.publish_if_due()
        except FlywheelError as exc:
            log.warning("publishing the weights failed; asking again at the next step",
                        extra={"step": self.engine.info().step, "error": str(exc)})
            return False
        return True

    async def publish_if_due(self) -> ExportResult | None:
        async with self._lock:
            step = self.engine.info().step
            decision = await self.client.need_sync(self.trainer_id, step)
            if not decision.need_sync or step < 1:
                return None
            return await self._publish(decision.method or Method.MEMORY, decision.version)

    async def _publish(self, method: Method, version: int) -> ExportResult:
        log.info("publishing weights", extra={"method": method.name.lower(), "version": version})
        if method == Method.MEMORY:
            return await self.exporter.memory(merge_lora=True)
        if method == Method.CHECKPOINT:
            return await self.exporter.checkpoint(merge_lora=True)
        # Every rollout registered now; the synchronizer's own deadline and backend (auto: nccl on CUDA).
        group = await self.client.allocate_group(version, self.trainer_id, [])
        return await self.exporter.nccl(group.group_id, merge_lora=True)

    async def _watch_loop(self) -> None:
        """Publishes between steps when the synchronizer asks (see WAKES).

        A wake sent while this stream was down is lost (a restarted synchronizer asks for the run's
        version before the trainer is back on its stream), and a trainer waiting for data takes no
        step that would ask again: the run would wait forever. So every stream after the first asks
        on its first event, and on every event after until an ask succeeds (the trainer may not be
        registered again yet; its registration is an event too). The synchronizer subscribes a stream
        before it sends the snapshot (send_initial), so nothing asked after that first event is missed."""
        sync = self.config.sync
        backoff = Backoff(sync.retry_initial_seconds, sync.retry_max_seconds)
        first_stream = True
        while True:
            try:
                catch_up = not first_stream
                first_stream = False
                async for event in self.client.watch([], send_initial=True):
                    backoff.reset()
                    if catch_up or event.kind in WAKES:
                        published = await self.after_step()
                        catch_up = catch_up and not published
                continue
            except Exception as exc:  # noqa: BLE001 - a broken stream is retried, never fatal to the trainer
                log.warning("watching the synchronizer failed; reconnecting",
                            extra={"error": str(exc), "retry_seconds": backoff.delay})
            await backoff.wait()
