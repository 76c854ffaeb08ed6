"""The validator: scores the current policy on the validation set.

Every `interval` weight versions (and before training when asked) the
pipeline pauses training rollouts, and the validator runs the same rollout
worker over the validation loader (in order, once, greedy unless configured)
all at once by default (`validation.max_in_flight`), so the engine batches
the whole pass; then training rollouts resume. Metrics are the
means of every score key over the validation trajectories, named `val/<key>`
(e.g. `val/reward`, `val/accuracy`), plus `val/samples`, `val/failed` and
`val/seconds` (the pass's wall time).
Validation samples never enter the trajectory pool.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from services.controller.tasks.loader import DataLoader
from services.controller.domain import MIN_WEIGHT_VERSION, RolloutStatus, SamplingSpec, Task
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.workers.base import RolloutWorker


class Validator:
    def __init__(
        self,
        worker: RolloutWorker,
        loader: DataLoader,
        errors: ErrorReporter,
        *,
        interval: int,
        n: int = 1,
        sampling: SamplingSpec | None = None,
        max_samples: int | None = None,
        concurrency: int | None = None,
        timeout_seconds: float = 600.0,
    ) -> None:
        self.worker, self.loader, self.errors = worker, loader, errors
        self.interval, self.n = interval, n
        self.sampling = sampling or SamplingSpec(temperature=0.0)
        self.max_samples, self.concurrency, self.timeout_seconds = max_samples, concurrency, timeout_seconds
        self.last_version: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def due(self, version: int) -> bool:
        """Whether `version` completes another `interval` versions since the last validation."""
        if self.interval <= 0:
            return False
        if self.last_version is None:
            return version % self.interval == 0
        return version - self.last_version >= self.interval

    def _tasks(self) -> list[Task]:
        self.loader.reset()
        tasks = []
        while (task := self.loader.next()) is not None:
            tasks.append(task)
            if self.max_samples is not None and len(tasks) >= self.max_samples:
                break
        return tasks

    async def run(self, version: int) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        failed = 0
        tasks = self._tasks()
        limit = asyncio.Semaphore(self.concurrency or max(1, len(tasks)))

        async def one(task: Task) -> None:
            nonlocal failed
            async with limit:
                try:
                    outcome = await asyncio.wait_for(self.worker.rollout(task, self.n, self.sampling), self.timeout_seconds)
                except Exception as exc:  # validation must not end the run
                    self.errors.report("validator", exc, severity="warning", context={"task": task.id})
                    failed += 1
                    return
            if outcome.status != RolloutStatus.SUCCESS:
                failed += 1
                return
            for t in outcome.trajectories:
                for key, value in t.scores.items():
                    sums[key] += value
                    counts[key] += 1

        # Every generation of this pass is made with `version` or newer (replicas move there first).
        token = MIN_WEIGHT_VERSION.set(version)
        started = time.monotonic()
        try:
            await asyncio.gather(*(one(task) for task in tasks))
        finally:
            MIN_WEIGHT_VERSION.reset(token)
        metrics = {f"val/{key}": sums[key] / counts[key] for key in sorted(sums)}
        metrics["val/samples"] = float(max(counts.values(), default=0))
        metrics["val/failed"] = float(failed)
        metrics["val/seconds"] = time.monotonic() - started
        self.last_version = version
        self.history.append((version, metrics))
        return metrics
