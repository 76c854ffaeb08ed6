"""The algorithm processor and the train batch pool.

The processor takes released groups from the trajectory pool one at a time
and for each:

1. checks it against the version of the batch it would join; a group made
   by a version newer than that came from weights the run no longer has (a
   lineage lost with a trainer, see the rewind in docs/architecture.md): it
   is dropped and its task re-queued; a group over the staleness limit is
   dropped (its task re-queued: retried on fresher weights) or, with policy
   "correct", kept for the trainer's importance-sampling correction; a group
   every policy token of which is past the per-token bound (`TokenBound`,
   every mode's, fully-async's too) and would be masked is dropped and retried
   as well: it would train nothing;
2. runs the algorithm (reward shaping, advantages, dynamic-sampling
   filter); a dropped group frees its slots at the gate so rollouts refill
   the batch with effective groups;
3. adds it to the batch being assembled; a full batch becomes tensors and
   goes to the train batch pool, its tokens past the per-token bound masked
   out of the loss or, with "correct", left for the correction (batching.py).

How groups are ordered into batches depends on `staleness.policy`:

- `drop` and `correct` (and any run without a bound): in completion order.
  A group that finishes late (a long answer) can find the batches it was
  planned for already filled by groups admitted after it; over the bound it
  is dropped and retried, or trained with IS correction.
- `pace` (with a bound): by deadline. A group's *deadline* is the last
  batch version it may join without going over the bound: `oldest start
  version + limit` once it finished, its planned version (staleness.py)
  while it is in flight, plus `in_flight_slack` when rollouts are started
  fewer versions ahead than the bound allows (staleness.lookahead). Finished groups wait in the processor; batch V is
  closed with the B samples of earliest deadline (ties: completion order),
  and only when what is left, with every group still in flight, can still
  meet its deadline in batches V+1, V+2, ...: for every d, the samples with
  deadline <= d fit in (d - V) batches. If they do not and a later-deadline
  group took a place an in-flight one needs, the processor waits for the
  straggler: a bounded wait (a rollout ends or times out) that is the price
  of the bound. The gate admits nothing that breaks this (it admits each
  group only into a batch within its deadline, counting everything admitted
  before it), so no finished group goes over the bound and nothing is thrown
  away. A group that does (a replica that served older weights than the gate
  planned for, e.g. one that came back from an outage) is dropped as
  in `drop`, the safety net.

When the trajectory pool closes (data exhausted) a partial batch is trained
or dropped per `drop_last`, then the train batch pool closes and the main
loop's `next_batch()` returns None.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from services.controller.telemetry.activity import now
from services.controller.batches.algorithms import Algorithm
from services.controller.batches.batching import UNBOUNDED, TokenBound, TrainBatch, build_train_batch, stale_everywhere
from services.controller.domain import Task, Trajectory
from services.controller.batches.pool import PoolInstance
from services.controller.batches.sample_age import bucket_of, completion_length
from services.controller.batches.staleness import StalenessGate, is_stale


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


@dataclass(eq=False)
class _Held:
    """A finished group, processed, waiting for its batch (policy pace)."""

    deadline: int
    seq: int
    group: list[Trajectory]


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
        stale_policy: str = "pace",
        token_bound: TokenBound = UNBOUNDED,
        in_flight_slack: int = 0,
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
        #: The per-token bound each batch enforces (batching.py).
        self.token_bound = token_bound
        #: Groups dropped, by reason ("stale", "equal_rewards", ...).
        self.dropped: Counter[str] = Counter()
        #: Samples dropped as stale, by completion-length bucket (sample_age.py): the length bias of `drop`.
        self.stale_by_length: Counter[str] = Counter()
        self.groups_accepted = 0
        #: Pacing: a bound to pace by (policy pace with a staleness limit).
        self.paced = stale_policy == "pace" and staleness_limit is not None
        #: Pacing: versions a group in flight may slip past its planned batch (RunConfig.pace_slack).
        self.in_flight_slack = in_flight_slack
        #: Pacing: times a batch waited for an in-flight straggler, and the time spent waiting.
        self.pace_waits = 0
        self.pace_wait_seconds = 0.0
        self._seq = itertools.count()

    def _whole_task(self, group: list[Trajectory]) -> bool:
        return len(group) == self.group_size and len({t.task.id for t in group}) == 1

    def _drop(self, group: list[Trajectory], reason: str, retry: bool) -> None:
        self.gate.drop(len(group))
        self.dropped[reason] += 1
        if reason == "stale":
            self.stale_by_length.update(bucket_of(completion_length(t)) for t in group)
        if retry and self._whole_task(group):
            self.requeue(group[0].task)
        else:
            for task_id in {t.task.id for t in group}:
                self.finish(task_id)

    def _batch(self, trajectories: list[Trajectory], version: int) -> TrainBatch:
        return build_train_batch(trajectories, version, self.pad_id, self.token_bound)

    async def run(self) -> None:
        if self.paced:
            await self._run_paced()
        else:
            await self._run_in_completion_order()

    async def _run_in_completion_order(self) -> None:
        batch: list[Trajectory] = []
        while (group := await self.pool.get_group()) is not None:
            version = self.gate.next_batch_version
            if max(_newest_version(t) for t in group) > version:
                self._drop(group, "lost weights", retry=True)
                continue
            if is_stale(min(t.version for t in group), version, self.limit) and self.stale_policy != "correct":
                self._drop(group, "stale", retry=True)
                continue
            if stale_everywhere(group, version, self.token_bound):
                self._drop(group, "stale", retry=True)  # every token would be masked: it would train nothing
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
                await self.out.put(self._batch(ready, version))
        if batch and not self.drop_last:
            await self.out.put(self._batch(batch, self.gate.next_batch_version))
        elif batch:
            for task_id in {t.task.id for t in batch}:
                self.finish(task_id)
        await self.out.close()

    # -- policy pace --------------------------------------------------------------
    async def _run_paced(self) -> None:
        held: list[_Held] = []
        waiting_since: float | None = None
        while True:
            while self.pool.store.ready():  # everything finished is known before a batch is chosen
                group = await self.pool.get_group()
                if group is not None:
                    self._take(group, held)
            chosen = self._choose(held, final=False)
            if chosen is not None:
                if waiting_since is not None:
                    self.pace_wait_seconds += now() - waiting_since
                    waiting_since = None
                await self._emit(chosen, held)
                continue
            if waiting_since is None and sum(len(h.group) for h in held) >= self.batch_size:
                self.pace_waits += 1  # a batch's worth is here: what is missing is a straggler
                waiting_since = now()
            # Wake on a finished group, or on a change at the gate (a straggler given up).
            arrival = asyncio.ensure_future(self.pool.get_group())
            change = asyncio.ensure_future(self.gate.changed())
            try:
                await asyncio.wait([arrival, change], return_when=asyncio.FIRST_COMPLETED)
            finally:
                change.cancel()
                if not arrival.done():
                    arrival.cancel()  # it took no group: cancelled while waiting
            if arrival.done() and not arrival.cancelled():
                group = arrival.result()
                if group is None:
                    break  # the pool closed: data exhausted
                self._take(group, held)
        if waiting_since is not None:
            self.pace_wait_seconds += now() - waiting_since
        while (chosen := self._choose(held, final=True)) is not None:
            await self._emit(chosen, held)
        rest = [t for h in sorted(held, key=_edf) for t in h.group]
        if rest and not self.drop_last:
            version = self.gate.next_batch_version
            self.gate.accept(len(rest))
            await self.out.put(self._batch(rest, version))
        else:
            for task_id in {t.task.id for t in rest}:
                self.finish(task_id)
        await self.out.close()

    def _take(self, group: list[Trajectory], held: list[_Held]) -> None:
        version = self.gate.next_batch_version
        if max(_newest_version(t) for t in group) > version:
            self._drop(group, "lost weights", retry=True)
            return
        assert self.limit is not None
        deadline = min(t.version for t in group) + self.limit
        if deadline < version:
            self._drop(group, "stale", retry=True)  # the safety net: see the module docstring
            return
        reason = self.algorithm(group)
        if reason is not None:
            self._drop(group, reason, retry=False)
            return
        held.append(_Held(deadline, next(self._seq), group))

    def _choose(self, held: list[_Held], *, final: bool) -> list[_Held] | None:
        """The groups of the next batch, earliest deadline first, or None to wait.

        Waits while fewer than B samples are held, or while closing the batch now
        would leave some group in flight unable to meet its deadline although a
        group with a later deadline took a place in this batch (after `final`,
        with nothing in flight, it never waits for a straggler)."""
        b = self.batch_size
        if sum(len(h.group) for h in held) < b:
            return None
        order = sorted(held, key=_edf)
        chosen, n = [], 0
        for h in order:
            if n >= b:
                break
            chosen.append(h)
            n += len(h.group)
        if final:
            return chosen
        version = self.gate.next_batch_version
        rest: Counter[int] = Counter()
        for h in order[len(chosen):]:
            rest[h.deadline] += len(h.group)
        rest[chosen[-1].deadline] += n - b  # the part of a group that does not fit stays
        for planned in self.gate.in_flight():
            rest[planned.version + self.in_flight_slack] += planned.samples
        latest = max(h.deadline for h in chosen)
        later = 0
        for deadline in sorted(rest):
            later += rest[deadline]
            if deadline >= latest:
                break  # swapping a chosen group for one due by here would not help
            if later > (deadline - version) * b:
                return None  # a straggler due by `deadline` needs a place a chosen group holds
        return chosen

    async def _emit(self, chosen: list[_Held], held: list[_Held]) -> None:
        b = self.batch_size
        version = self.gate.next_batch_version
        ready: list[Trajectory] = []
        for h in chosen:
            held.remove(h)
            room = b - len(ready)
            if len(h.group) > room:  # batch size not a multiple of the unit: split as in completion order
                ready.extend(h.group[:room])
                held.append(_Held(h.deadline, h.seq, h.group[room:]))
            else:
                ready.extend(h.group)
                self.groups_accepted += 1
        self.gate.accept(len(ready))
        await self.out.put(self._batch(ready, version))
        # Groups left that can no longer make any batch within the bound (only after
        # an anomaly: see the module docstring).
        for h in [h for h in held if h.deadline < self.gate.next_batch_version]:
            held.remove(h)
            self._drop(h.group, "stale", retry=True)


def _edf(h: _Held) -> tuple[int, int]:
    return h.deadline, h.seq


def _newest_version(t: Trajectory) -> int:
    """The newest weight version that made any of its tokens."""
    return max([t.version_end, *(end for _, end in t.turn_versions)])
