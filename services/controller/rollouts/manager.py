"""The rollout manager: keeps many rollouts in flight and routes their outcomes.

Each of `max_in_flight` + `scoring_slots` slots loops, holding one of
`max_in_flight` generation permits while it generates:

    take a generation permit                (handed back once only scoring is left)
    admit n samples at the staleness gate   (batch-async / sync may block here)
    plan them into a batch                  (the run step replicas see; the group's deadline)
    reserve room for them in the pool       (producers wait when it is full)
    wait while no rollout replica serves     (one restarting: tasks' retries are not used up)
    take the next task from the loader
    worker.rollout(task)                    (tracked as in-flight activity; a remote judge's
                                             scores are awaited without the permit)
    the teacher's log-probs                 (on-policy distillation: tasks/teacher.py; without
                                             the permit too)
    SUCCESS    -> trajectories into the pool
    RE_ROLLOUT -> task back at the front of the loader (retried, not lost)
    FAIL       -> error recorded, task given up

`pause()` stops slots from starting new rollouts (in-flight ones finish);
sync mode pauses while weights move, validation while it runs. When the
loader is empty, nothing is in flight and the pool is empty, the data is
done: the pool is closed, which lets the processor flush and the loop end.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable

from services.controller.telemetry.activity import ActivityTracker
from services.controller.tasks.loader import DataLoader
from services.controller.domain import (
    GENERATION_DONE, RUN_STEP, RolloutOutcome, RolloutStatus, SamplingSpec, Task, TrajectoryStatus,
)
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.batches.pool import PoolInstance
from services.controller.batches.staleness import Planned, StalenessGate
from services.controller.tasks.teacher import Teacher
from services.controller.workers.base import RolloutWorker

log = logging.getLogger(__name__)

#: How often slots with nothing left to run check whether the data is done (see `_wait_for_work`).
DATA_DONE_POLL_SECONDS = 0.5


class RolloutManager:
    def __init__(
        self,
        worker: RolloutWorker,
        loader: DataLoader,
        pool: PoolInstance,
        gate: StalenessGate,
        tracker: ActivityTracker,
        errors: ErrorReporter,
        *,
        group_size: int,
        sampling: SamplingSpec,
        max_in_flight: int,
        max_retries: int = 3,
        timeout_seconds: float = 600.0,
        retry_backoff_seconds: float = 0.5,
        until_a_replica_serves: Callable[[], Awaitable[object]] | None = None,
        scoring_slots: int = 0,
        teacher: Teacher | None = None,
    ) -> None:
        self.worker, self.loader, self.pool, self.gate = worker, loader, pool, gate
        self.tracker, self.errors = tracker, errors
        self.group_size, self.sampling = group_size, sampling
        self.max_in_flight, self.max_retries = max_in_flight, max_retries
        self.timeout_seconds, self.retry_backoff_seconds = timeout_seconds, retry_backoff_seconds
        #: Waits while no replica serves (the pipeline stops the run if that lasts too long).
        self.until_a_replica_serves = until_a_replica_serves
        #: Slots beyond max_in_flight, for groups whose generation is done and whose scores are awaited (a
        #: remote judge): max_in_flight stays the number generating, held as `_generating` permits.
        self.scoring_slots = scoring_slots
        #: On-policy distillation: scores each generated group's tokens before it is pooled.
        self.teacher = teacher
        self._generating = asyncio.Semaphore(max_in_flight)
        self.retries: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self.data_done = False
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Event()
        self._slots: list[asyncio.Task] = []

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- control -------------------------------------------------------------
    def start(self) -> None:
        self._slots = [asyncio.ensure_future(self._slot()) for _ in range(self.max_in_flight + self.scoring_slots)]

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def stop(self) -> None:
        self.gate.close()
        for slot in self._slots:
            slot.cancel()
        await asyncio.gather(*self._slots, return_exceptions=True)
        self._slots = []

    # -- callbacks of the processor and the train worker ---------------------
    def requeue(self, task: Task) -> None:
        """Serve `task` again first (its samples were dropped as stale)."""
        self.loader.put_back(task)
        self.stats["requeued"] += 1
        self._notify()

    def finish(self, task_id: str) -> None:
        self.loader.finish(task_id)
        self._notify()

    # -- the slots ------------------------------------------------------------
    async def _slot(self) -> None:
        while True:
            await self._running.wait()
            # A slot takes a task only with a generation permit; its worker hands it back once only
            # scoring is left (GENERATION_DONE), and a slot of scoring_slots takes the next task meanwhile.
            await self._generating.acquire()
            permit = _Permit(self._generating)
            try:
                turn = await self._turn(permit)
            finally:
                permit.release()
            if turn == "end":
                return
            if turn == "backoff":
                await asyncio.sleep(self.retry_backoff_seconds)

    async def _turn(self, permit: _Permit) -> str:
        """One task through a slot: "next", "backoff" (before the next), or "end" (the run is ending)."""
        n = self.group_size
        if not await self.gate.admit(n):
            return "end"  # the gate closed: the run is ending
        # The batch these samples are planned into; replicas count their steps by it,
        # and the processor paces assembly by it while the group is in flight.
        planned = self.gate.plan(n)
        RUN_STEP.set(planned.run_step)
        await self.pool.reserve(n)
        # Checked last, right before a task is taken: the wait at the gate may be long.
        if self.until_a_replica_serves is not None:
            await self.until_a_replica_serves()
        task = self.loader.next() if self._running.is_set() else None
        if task is None:
            self.gate.landed(planned)
            self.gate.drop(n)
            self.pool.release(n)
            permit.release()  # nothing generates while this slot waits for work
            if self._running.is_set() and not await self._wait_for_work():
                return "end"
            return "next"
        GENERATION_DONE.set(permit.release)
        with self.tracker.track("rollout", task.id):
            outcome = await self._run(task)
        return "backoff" if self._handle(task, outcome, planned) else "next"

    async def _wait_for_work(self) -> bool:
        """With the loader empty: False once the data is done, True when a task may be back."""
        if self.loader.has_more():
            return True
        if self.tracker.in_flight("rollout") == 0 and len(self.pool.store) == 0:
            if not self.data_done:
                self.data_done = True
                log.info("data exhausted: closing the trajectory pool")
                self.pool.close()
                self.gate.close()
            return False
        # The processor empties the pool without telling us: look again now and then, or
        # the last groups of a data set that is not a multiple of the batch size, held
        # in a partial batch until the pool closes, would wait for each other forever.
        try:
            await asyncio.wait_for(self._changed.wait(), DATA_DONE_POLL_SECONDS)
        except TimeoutError:
            pass
        return True

    async def _run(self, task: Task) -> RolloutOutcome:
        try:
            outcome = await asyncio.wait_for(self.worker.rollout(task, self.group_size, self.sampling),
                                             self.timeout_seconds)
        except TimeoutError:
            return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error=f"rollout timed out after {self.timeout_seconds:g}s")
        except Exception as exc:  # a bug in a (user) worker must not take the run down
            return RolloutOutcome(RolloutStatus.FAIL, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        if self.teacher is not None and outcome.status == RolloutStatus.SUCCESS and outcome.trajectories:
            if (generation_done := GENERATION_DONE.get()) is not None:
                generation_done()  # the teacher's call holds no generation permit
            error = await self.teacher.score_group(outcome.trajectories)
            if error is not None:
                return RolloutOutcome(RolloutStatus.FAIL, outcome.trajectories, error=error)
        return outcome

    def _handle(self, task: Task, outcome: RolloutOutcome, planned: Planned | None = None) -> bool:
        """Routes an outcome; True when the slot should back off before its next task."""
        n = self.group_size
        if planned is not None:
            self.gate.landed(planned)  # pooled or given up below, in the same turn
        status = outcome.status
        if status == RolloutStatus.SUCCESS:
            trajectories = outcome.trajectories
            if len(trajectories) != n or any(t.status != TrajectoryStatus.OK for t in trajectories):
                status = RolloutStatus.FAIL
                outcome.error = outcome.error or f"worker returned {len(trajectories)} trajectories, expected {n}"
        if status == RolloutStatus.RE_ROLLOUT:
            self.retries[task.id] += 1
            if self.retries[task.id] > self.max_retries:
                status = RolloutStatus.FAIL
                outcome.error = f"gave up after {self.max_retries} retries: {outcome.error}"
        self.stats[status.value] += 1
        self.stats["failed_trajectories"] += sum(t.status == TrajectoryStatus.FAILED for t in outcome.trajectories)
        backoff = False
        if status == RolloutStatus.SUCCESS:
            self.retries.pop(task.id, None)
            self.pool.put(outcome.trajectories, reserved=n)
        else:
            self.gate.drop(n)
            self.pool.release(n)
            if status == RolloutStatus.RE_ROLLOUT:
                self.loader.put_back(task)
                # "no replica answered" would otherwise spin; an abort retries at once.
                backoff = "aborted" not in (outcome.error or "")
            else:
                self.errors.report(
                    "rollout_worker", outcome.error or "rollout failed", severity="error",
                    context={"task": task.id}, traceback=outcome.traceback,
                )
                self.loader.finish(task.id)
        self._notify()
        return backoff


class _Permit:
    """A slot's generation permit, handed back once (by the worker when only scoring is left, or by the slot)."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore: asyncio.Semaphore | None = semaphore

    def release(self) -> None:
        if self._semaphore is not None:
            self._semaphore.release()
            self._semaphore = None
