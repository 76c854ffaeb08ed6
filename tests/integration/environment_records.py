"""The openenv worker of tests/integration/test_openenv.py, loaded by the controller by name: it writes each
episode's generations (what the replicas sampled, as they returned it) beside the trajectory trained from
them to ENVIRONMENT_RECORDS (JSONL), for the test to compare."""

from __future__ import annotations

import json
import os
from typing import Any

from services.controller.domain import SamplingSpec, Task, Trajectory
from services.controller.workers.environment import EnvironmentWorker


class _RecordingEngines:
    """The worker's engine pool, keeping every generation it returns by the episode's sticky key."""

    def __init__(self, engines: Any) -> None:
        self._engines, self.generations = engines, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engines, name)

    async def generate(self, requests, sampling, *, sticky=None, **kwargs):
        out = await self._engines.generate(requests, sampling, sticky=sticky, **kwargs)
        self.generations.setdefault(sticky, []).extend(g for group in out for g in group)
        return out


class RecordingEnvironmentWorker(EnvironmentWorker):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.ctx.engines = self.recording = _RecordingEngines(ctx.engines)

    async def episode(self, task: Task, index: int, sampling: SamplingSpec) -> Trajectory:
        t = await super().episode(task, index, sampling)
        generations = self.recording.generations.pop(f"{task.id}#{index}", [])
        row = {"task": task.id, "sample": index,
               "generations": [{"completion_token_ids": g.completion_token_ids, "logprobs": g.completion_logprobs,
                                "prompt_token_ids": g.prompt_token_ids} for g in generations],
               "trajectory": {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
                              "response_logprobs": t.response_logprobs, "response_mask": t.response_mask}}
        with open(os.environ["ENVIRONMENT_RECORDS"], "a") as out:
            out.write(json.dumps(row) + "\n")
        return t
