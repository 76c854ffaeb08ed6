"""The algorithm processor and the train batch pool.

The processor takes released groups from the trajectory pool one at a time,
in completion order, and for each:

1. checks it against the version of the batch it would join; a group made
   by a version newer than that came from weights the run no longer has (a
   lineage lost with a trainer, see the rewind in docs/architecture.md): it
   is dropped and its task re-queued; a group over the staleness limit is dropped (its task re-queued: retried on fresher
   weights) or, with policy "correct", kept for the trainer's importance-
   sampling correction;
2. runs the algorithm (reward shaping, advantages, dynamic-sampling
   filter); a dropped group frees its slots at the gate so rollouts refill
   the batch with effective groups;
3. appends it to the batch being assembled; a full batch becomes tensors
   and goes to the train batch pool.

When the trajectory pool closes (data exhausted) a partial batch is trained
or dropped per `drop_last`, then the train batch pool closes and the main
loop's `next_batch()` returns None.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from services.controller.algorithms import Algorithm
from services.controller.batching import TrainBatch, build_train_batch
from services.controller.domain import Task, Trajectory
from services.controller.pool import PoolInstance
from services.controller.staleness import StalenessGate, is_stale


class TrainBatchPool:
    """A bounded queue of ready batches; `get()` returns None once closed and empty."""

    def __init__(self, maxsize: int = 1) -> None:
        self._queue: asyncio.Queue[TrainBatch | None] = asyncio.Queue(maxsize)
        self.closed = False

    async def put(self, batch: TrainBatch) -> None:
        await self._queue.put(batch)

    async def close(self) -> None:
        self.closed = True
        await self._queue.put(None)

    async def get(self) -> TrainBatch | None:
        batch = await self._queue.get()
        if batch is None:
            self._queue.put_nowait(None)  # every later get() sees the end too
        return batch

    def get_nowait(self) -> TrainBatch | None:
        """A ready batch, or None if none is waiting (the end marker stays queued)."""
        if self._queue.empty():
            return None
        batch = self._queue.get_nowait()
        if batch is None:
            self._queue.put_nowait(None)
        return batch

    def qsize(self) -> int:
        return sum(1 for b in self._queue._queue if b is not None)  # type: ignore[attr-defined]


class AlgorithmProcessor:
    def __init__(
        self,
        pool: PoolInstance,
        algorithm: Algorithm,
        gate: StalenessGate,
        out: TrainBatchPool,
        *,
        batch_size: int,
        group_size: int,
        staleness_limit: int | None,
        stale_policy: str = "drop",
        drop_last: bool = True,
        requeue: Callable[[Task], None],
        finish: Callable[[str], None],
        pad_id: int = 0,
    ) -> None:
        self.pool, self.algorithm, self.gate, self.out = pool, algorithm, gate, out
        self.batch_size, self.group_size = batch_size, group_size
        self.limit, self.stale_policy, self.drop_last = staleness_limit, stale_policy, drop_last
        self.requeue, self.finish = requeue, finish
        self.pad_id = pad_id
        #: Groups dropped, by reason ("stale", "equal_rewards", ...).
        self.dropped: Counter[str] = Counter()
        self.groups_accepted = 0

    def _whole_task(self, group: list[Trajectory]) -> bool:
        return len(group) == self.group_size and len({t.task.id for t in group}) == 1

    def _drop(self, group: list[Trajectory], reason: str, retry: bool) -> None:
        self.gate.drop(len(group))
        self.dropped[reason] += 1
        if retry and self._whole_task(group):
            self.requeue(group[0].task)
        else:
            for task_id in {t.task.id for t in group}:
                self.finish(task_id)

    async def run(self) -> None:
        batch: list[Trajectory] = []
        while (group := await self.pool.get_group()) is not None:
            version = self.gate.next_batch_version
            if max(_newest_version(t) for t in group) > version:
                self._drop(group, "lost weights", retry=True)
                continue
            if is_stale(min(t.version for t in group), version, self.limit) and self.stale_policy == "drop":
                self._drop(group, "stale", retry=True)
                continue
            reason = self.algorithm(group)
            if reason is not None:
                self._drop(group, reason, retry=False)
                continue
            self.gate.accept(len(group))
            self.groups_accepted += 1
            batch.extend(group)
            if len(batch) >= self.batch_size:
                ready, batch = batch[: self.batch_size], batch[self.batch_size :]
                await self.out.put(build_train_batch(ready, version, self.pad_id))
        if batch and not self.drop_last:
            await self.out.put(build_train_batch(batch, self.gate.next_batch_version, self.pad_id))
        elif batch:
            for task_id in {t.task.id for t in batch}:
                self.finish(task_id)
        await self.out.close()


def _newest_version(t: Trajectory) -> int:
    """The newest weight version that made any of its tokens."""
    return max([t.version_end, *(end for _, end in t.turn_versions)])
