"""The OpenEnv environment worker: an episode is one session (reset, a step per model turn, the
model's text as the action), trained on exactly the sampled tokens with the environment's observations
masked out, rewarded by the environment alone; an unreachable environment retries the task, one that
answers an error fails it; sessions are bounded. The WebSocket transport against a real server is in
tests/integration/test_openenv.py."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.controller.domain import RolloutStatus, SamplingSpec, Task
from services.controller.rollouts.balancer import EnginePool
from services.controller.run_config import EnvironmentConfig
from services.controller.tasks.rewards import get_reward
from services.controller.workers import EnvironmentWorker, WorkerContext, worker_class
from services.controller.workers.environment import EnvironmentRefused, EnvironmentUnavailable
from tests.unit.controller.controller_helpers import config
from tests.unit.controller.test_controller_workers import ScriptedEngine


class GuessEnvironment:
    """Asks for a number; a wrong guess gets "higher"/"lower" and another turn, the right one reward 1."""

    def __init__(self, log: list, fail: Exception | None = None) -> None:
        self.log, self.fail, self.target = log, fail, 0

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        self.log.append(("reset", kwargs))
        self.target = kwargs["seed"] % 10
        return {"observation": {"prompt": "Guess my number (0-9)."}, "reward": None, "done": False}

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        self.log.append(("step", action))
        if self.fail is not None:
            raise self.fail
        guess = int(action["message"])
        if guess == self.target:
            return {"observation": {"prompt": "Yes."}, "reward": 1.0, "done": True,
                    "metadata": {"accuracy": 1.0, "hint": "none"}}
        return {"observation": {"prompt": "higher" if guess < self.target else "lower"}, "reward": -0.1,
                "done": False, "metadata": {"accuracy": 0.0}}


def environment(log: list, fail: Exception | None = None, opened: list | None = None):
    @asynccontextmanager
    async def open_session():
        if opened is not None:
            opened.append(1)
            await asyncio.sleep(0.01)
        yield GuessEnvironment(log, fail)
        if opened is not None:
            opened.pop()

    return open_session


def worker(engine: ScriptedEngine, log: list, *, fail: Exception | None = None, opened: list | None = None,
           **env: Any) -> EnvironmentWorker:
    cfg = EnvironmentConfig(url="http://env.test", observation_template="[env] {observation} [/env] ", **env)
    return EnvironmentWorker(WorkerContext(engines=EnginePool([engine]), reward=get_reward("math"), max_turns=3,
                                           environment=environment(log, fail, opened), environment_config=cfg))


def task(seed: int = 7) -> Task:
    return Task(id=f"train:0:{seed}", index=seed, epoch=0, prompt="", data={"seed": seed, "level": "easy"})


async def test_an_episode_plays_the_environment_and_trains_only_the_models_tokens() -> None:
    log: list = []
    engine = ScriptedEngine("e", ["3", "9", "7"])
    outcome = await worker(engine, log, reset_fields=["level"]).rollout(task(7), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS
    t = outcome.trajectories[0]
    # The environment's reward alone: two wrong guesses (-0.1 each), then the right one.
    assert t.reward == pytest.approx(0.8) and t.scores["reward"] == pytest.approx(0.8)
    assert t.scores["env_turns"] == 3 and t.scores["env_done"] == 1.0 and t.scores["accuracy"] == 1.0
    assert "hint" not in t.scores  # numbers only
    assert log[0] == ("reset", {"seed": 7, "episode_id": "train:0:7#0", "level": "easy"})  # the row's own seed
    assert [entry for kind, entry in log if kind == "step"] == [{"message": "3"}, {"message": "9"}, {"message": "7"}]
    # Three model turns (mask 1, their log-probs) with the observations between them (mask 0, log-prob 0).
    runs = [(m, len(list(g))) for m, g in itertools.groupby(t.response_mask)]
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assert all(lp == 0.0 for lp, m in zip(t.response_logprobs, t.response_mask) if m == 0)
    assert "[env] higher [/env]" in t.text and "[env] lower [/env]" in t.text
    # Each turn generated from the prompt + everything so far, as token ids: the trained tokens are the sampled.
    assert engine.prompts[2].token_ids == [1, 2, 3, 4] + t.response_ids[:-3]


async def test_the_episode_ends_after_max_turns_not_done() -> None:
    log: list = []
    outcome = await worker(ScriptedEngine("e", ["0"] * 9), log).rollout(task(7), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS
    assert [t.scores["env_turns"] for t in outcome.trajectories] == [3, 3]
    assert all(t.scores["env_done"] == 0.0 and t.reward == pytest.approx(-0.3) for t in outcome.trajectories)
    # Every episode of the group played the same task (seed), each its own session.
    assert [e["seed"] for kind, e in log if kind == "reset"] == [7, 7]


async def test_an_unreachable_environment_retries_the_task_and_an_error_fails_it() -> None:
    log: list = []
    out = await worker(ScriptedEngine("e", ["1"]), log, fail=EnvironmentUnavailable("no session")).rollout(
        task(), 1, SamplingSpec())
    assert out.status == RolloutStatus.RE_ROLLOUT and "no session" in out.error
    out = await worker(ScriptedEngine("e", ["1"]), log, fail=EnvironmentRefused("step refused: bad action")).rollout(
        task(), 1, SamplingSpec())
    assert out.status == RolloutStatus.FAIL and "bad action" in out.error
    out = await worker(ScriptedEngine("e", ["1"]), log, reset_fields=["missing"]).rollout(task(), 1, SamplingSpec())
    assert out.status == RolloutStatus.FAIL and "missing" in out.error
    out = await worker(ScriptedEngine("e", ["1"]), log, prompt_field="question").rollout(task(), 1, SamplingSpec())
    assert out.status == RolloutStatus.FAIL and "no 'question'" in out.error and "prompt" in out.error


async def test_sessions_open_at_once_are_bounded() -> None:
    log: list = []
    opened: list = []
    peak = 0

    class Watching(ScriptedEngine):
        async def generate(self, prompts, sampling):
            nonlocal peak
            peak = max(peak, len(opened))
            await asyncio.sleep(0.01)
            return await super().generate(prompts, sampling)

    w = worker(Watching("e", ["7"] * 8), log, opened=opened, max_concurrency=2)
    outcome = await w.rollout(task(7), 8, SamplingSpec())
    assert outcome.status == RolloutStatus.SUCCESS and peak == 2


def test_the_openenv_worker_needs_its_environment_and_takes_no_reward_function() -> None:
    assert worker_class("openenv") is EnvironmentWorker
    env = {"url": "http://127.0.0.1:8000"}
    assert config(worker={"type": "openenv", "group_size": 4, "env": env}).worker.env.url == env["url"]
    with pytest.raises(ValueError, match="worker.env"):
        config(worker={"type": "openenv", "group_size": 4})
    with pytest.raises(ValueError, match="worker.env"):
        config(worker={"type": "math", "group_size": 4, "env": env})
    with pytest.raises(ValueError, match="environment's reward"):
        config(worker={"type": "openenv", "group_size": 4, "env": env}, reward={"name": "math"})
    with pytest.raises(ValueError, match="http"):
        config(worker={"type": "openenv", "group_size": 4, "env": {"url": "env.test:80"}})
    with pytest.raises(ValueError, match="instruction, chat false"):
        config(worker={"type": "openenv", "group_size": 4, "env": env, "instruction": "Think."})


def test_a_row_without_a_seed_gets_one_of_its_split_and_index() -> None:
    w = worker(ScriptedEngine("e", []), [])
    train = Task(id="train:0:3", index=3, epoch=0, prompt="", split="train")
    val = Task(id="val:0:3", index=3, epoch=0, prompt="", split="val")
    seeds = {t.split: w.reset_arguments(t, i)["seed"] for t in (train, val) for i in range(2)}
    assert seeds["train"] != seeds["val"], "a validation row would replay a training row's task"
    assert w.reset_arguments(train, 0)["seed"] == w.reset_arguments(train, 1)["seed"]  # one task a group
