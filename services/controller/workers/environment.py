"""`EnvironmentWorker` (worker.type openenv): episodes played in an OpenEnv environment server.

Each episode is one session of the environment (worker.env: its URL; the WebSocket transport is
services/controller/adapters/environment_ws.py):

1. reset, with the task row's `seed` (else one drawn from its split and index: every episode of
   a group plays the same task), an episode id, and the row fields named in `reset_fields`; the observation's
   `prompt_field` is the user's message (after `worker.system_prompt`), tokenized once by the
   engine's chat template;
2. each turn generates from the prompt + everything so far, as token ids (trained: mask 1, the
   sampler's log-probs); its text is the action (`action_field`) of one step;
3. the step's reward adds to the episode's; when it says done, or after `worker.max_turns` turns,
   the episode ends; otherwise the next observation, rendered with `observation_template`, joins
   the context as tokens that are never trained (mask 0).

The trajectory's reward is the environment's (the sum of its steps'), never a reward function's; its
scores carry that, the turns taken (`env_turns`), whether the environment said done (`env_done`), and
the numbers of the last step's metadata under their own names (an `accuracy` there is the run's
val/accuracy). At most `max_concurrency` sessions are open at once. A session that
cannot be opened or a call past its deadline retries the task (RE_ROLLOUT, up to worker.max_retries);
an error the environment answers fails it with the environment's message.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any, Protocol

from services.controller.domain import (
    GENERATION_DONE, PromptInput, RolloutOutcome, RolloutStatus, SamplingSpec, Task, Trajectory,
)
from services.controller.workers.base import RETRYABLE, RolloutWorker, WorkerContext
from services.controller.workers.transcript import EpisodeStopped, Transcript


class EnvironmentUnavailable(Exception):
    """The environment could not be reached in time: the episode is worth retrying."""


class EnvironmentRefused(Exception):
    """The environment answered with an error (or something that is not an observation)."""


class EnvironmentSession(Protocol):
    """One episode's session; each call returns the serialized observation: {"observation": {...},
    "reward": float | None, "done": bool, "metadata": {...}}."""

    async def reset(self, **kwargs: Any) -> dict[str, Any]: ...

    async def step(self, action: dict[str, Any]) -> dict[str, Any]: ...


#: Opens a session on the environment server (one an episode).
OpenSession = Callable[[], AbstractAsyncContextManager[EnvironmentSession]]


class EnvironmentWorker(RolloutWorker):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        if ctx.environment is None or ctx.environment_config is None:
            raise ValueError("the openenv worker needs its environment (worker.env)")
        self.config = ctx.environment_config
        self.open_session: OpenSession = ctx.environment
        self._sessions = asyncio.Semaphore(self.config.max_concurrency)

    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        try:
            trajectories = await asyncio.gather(*(self.episode(task, i, sampling) for i in range(n)))
        except EpisodeStopped as stop:
            return stop.outcome
        except (EnvironmentUnavailable, *RETRYABLE) as exc:
            self.stats["environment_unavailable"] += isinstance(exc, EnvironmentUnavailable)
            return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error=f"{type(exc).__name__}: {exc}")
        except EnvironmentRefused as exc:
            self.stats["environment_refused"] += 1
            return RolloutOutcome(RolloutStatus.FAIL, error=str(exc))
        if (generation_done := GENERATION_DONE.get()) is not None:
            generation_done()
        return RolloutOutcome(RolloutStatus.SUCCESS, list(trajectories))

    def reset_arguments(self, task: Task, index: int) -> dict[str, Any]:
        data = task.data or {}
        missing = [name for name in self.config.reset_fields if name not in data]
        if missing:
            raise EnvironmentRefused(f"task {task.id} has no {', '.join(missing)} (worker.env.reset_fields)")
        # The row's index is not enough: a validation row and a training row of the same index would play the
        # same task. Every episode of a group gets the same seed (one task, n samples).
        seed = int(data["seed"]) if "seed" in data else zlib.crc32(f"{task.split}:{task.index}".encode())
        return {"seed": seed, "episode_id": f"{task.id}#{index}", **{name: data[name] for name in self.config.reset_fields}}

    async def episode(self, task: Task, index: int, sampling: SamplingSpec) -> Trajectory:
        cfg, engines, key = self.config, self.ctx.engines, f"{task.id}#{index}"
        async with self._sessions, self.open_session() as env:
            result = await env.reset(**self.reset_arguments(task, index))
            messages = [{"role": "user", "content": self._shown(result)}]
            if self.ctx.system_prompt:
                messages.insert(0, {"role": "system", "content": self.ctx.system_prompt})
            episode = Transcript(await engines.tokenize(messages=messages, add_generation_prompt=True, sticky=key))
            reward, done = 0.0, False
            for turn in range(self.ctx.max_turns):
                request = PromptInput(request_id=f"{key}@{turn}", token_ids=episode.context)
                g = (await engines.generate([request], replace(sampling, n=1), sticky=key))[0][0]
                episode.model_turn(g)
                result = await env.step({cfg.action_field: g.text})
                reward += float(result.get("reward") or 0.0)
                done = bool(result.get("done"))
                if done or turn == self.ctx.max_turns - 1:
                    break
                rendered = cfg.observation_template.format(observation=self._shown(result))
                episode.world_turn(await engines.tokenize(text=rendered, add_generation_prompt=False, sticky=key),
                                   rendered)
        numbers = {k: float(v) for k, v in (result.get("metadata") or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "reward"}
        scores = {**numbers, "reward": reward, "env_turns": float(len(episode.starts)), "env_done": float(done)}
        return episode.trajectory(task, index, self.ctx.model_tag, reward=reward, scores=scores)

    def _shown(self, result: dict[str, Any]) -> str:
        observation = result.get("observation") or {}
        field = self.config.prompt_field
        if field not in observation:
            raise EnvironmentRefused(f"the observation has no {field!r} (worker.env.prompt_field); its fields: "
                                     f"{', '.join(sorted(observation)) or 'none'}")
        return str(observation[field])
