"""`SimpleRolloutWorker`: prompt -> n completions -> reward.

One Generate call with `n` samples per task (the engine shares the prompt's
prefill across them), then the configured reward scores each completion.
"""

from __future__ import annotations

from dataclasses import replace

from services.controller.domain import RolloutOutcome, RolloutStatus, SamplingSpec, Task
from services.controller.workers.base import RETRYABLE, RolloutWorker, check_generations


class SimpleRolloutWorker(RolloutWorker):
    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        try:
            results = await self.ctx.engines.generate([self.prompt_input(task)], replace(sampling, n=n))
        except RETRYABLE as exc:
            return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error=f"{type(exc).__name__}: {exc}")
        generations = results[0]
        if len(generations) != n:
            return RolloutOutcome(RolloutStatus.FAIL, error=f"engine returned {len(generations)} samples, asked {n}")
        forced = check_generations(generations)
        if forced is not None:
            return forced
        trajectories = [self.trajectory(task, g, i) for i, g in enumerate(generations)]
        return await self.score_all(task, trajectories)
