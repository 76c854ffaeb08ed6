"""The verifiers worker against an in-memory rollout session API (the external worker's test fakes) and a
simulated verifiers environment that "plays" an episode by calling the model through the session, as
verifiers' harness does, and reports what verifiers would: ok with its rewards and metrics, or errors."""

from __future__ import annotations

from typing import Any

import pytest

from flywheel.runtime.config import ConfigError
from services.controller.domain import RolloutStatus, SamplingSpec
from services.controller.rollouts.balancer import EnginePool
from services.controller.tasks.rewards import get_reward
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.workers import VerifiersWorker, WorkerContext
from services.controller.workers.verifiers import EpisodePlayed, sampling_body
from tests.unit.controller.controller_helpers import config, task
from tests.unit.controller.test_controller_external_agent import PROMPT, FakeReplica, FakeRollout


class SimulatedVerifiers:
    """Plays each episode with one model call through the session; `verdict` says how it ends."""

    def __init__(self, fake: FakeRollout, verdict: Any = None) -> None:
        self.fake, self.verdict = fake, verdict
        self.played: list[dict[str, Any]] = []
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def play(self, task: dict[str, Any], base_url: str, api_key: str, sampling: dict[str, Any],
                   timeout_seconds: float) -> EpisodePlayed:
        self.played.append({"task": task, "sampling": sampling, "timeout": timeout_seconds})
        finish = "abort" if self.verdict == "abort" else "stop"
        self.fake.chat(base_url, api_key, [30, 31, 32], text="\\boxed{4}", finish=finish)
        if self.verdict is None:
            return EpisodePlayed(ok=True, reward=0.5, scores={"accuracy": 1.0, "format": 0.0, "env_turns": 1.0})
        return EpisodePlayed(ok=False, reward=None, errors=["ProviderError: upstream stream ended"])


def worker(fake: FakeRollout, env: SimulatedVerifiers) -> VerifiersWorker:
    ctx = WorkerContext(engines=EnginePool([FakeReplica(fake)]), reward=get_reward("math"), verifiers=env,
                        agent_timeout_seconds=7.0, errors=ErrorReporter())
    return VerifiersWorker(ctx)


async def test_the_environments_reward_and_scores_on_the_tokens_the_session_recorded() -> None:
    fake = FakeRollout()
    env = SimulatedVerifiers(fake)
    w = worker(fake, env)
    await w.start()
    sampling = SamplingSpec(temperature=0.7, top_p=0.9, max_tokens=48, seed=3)
    outcome = await w.rollout(task(answer="4"), 2, sampling)
    assert outcome.status == RolloutStatus.SUCCESS
    for t in outcome.trajectories:
        # The environment's reward (0.5), not the run's math reward on "\boxed{4}" (which would be 1).
        assert t.reward == 0.5 and t.scores == {"reward": 0.5, "accuracy": 1.0, "format": 0.0, "env_turns": 1.0}
        assert t.prompt_ids == PROMPT and t.response_ids == [30, 31, 32] and t.response_mask == [1, 1, 1]
    # The run's sampling went to the environment's harness, and the episode's limit with it.
    assert env.played[0]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 48, "seed": 3}
    assert env.played[0]["timeout"] == 7.0
    assert env.played[0]["task"] == {"id": "train:0:0", "prompt": "question 0", "answer": "4", "data": {}}
    assert sorted(fake.deleted) == sorted(fake.opened) and len(fake.opened) == 2
    await w.close()
    assert env.started and env.closed


async def test_an_episode_verifiers_did_not_finish_fails_its_task_and_is_never_trained() -> None:
    fake = FakeRollout()
    w = worker(fake, SimulatedVerifiers(fake, verdict="failed"))
    outcome = await w.rollout(task(), 2, SamplingSpec())
    assert outcome.status == RolloutStatus.FAIL and outcome.trajectories == []
    assert "the environment's episode failed: ProviderError: upstream stream ended" in outcome.error
    assert w.stats["environment_errors"] == 2 and w.stats["agent_errors"] == 2


async def test_an_episode_that_failed_on_an_aborted_call_is_retried() -> None:
    fake = FakeRollout()
    w = worker(fake, SimulatedVerifiers(fake, verdict="abort"))
    outcome = await w.rollout(task(), 1, SamplingSpec())
    assert outcome.status == RolloutStatus.RE_ROLLOUT and "aborted" in outcome.error


def test_sampling_body_carries_only_what_is_set() -> None:
    assert sampling_body(SamplingSpec(temperature=1.0, top_p=1.0, max_tokens=8)) == \
        {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    assert sampling_body(SamplingSpec(top_k=5, stop=("\n",)))["top_k"] == 5
    assert sampling_body(None) == {}


VERIFIERS_WORKER = {"type": "verifiers", "group_size": 4, "verifiers": {"taskset": "flywheel-arithmetic"}}


def test_the_run_file_names_a_taskset_or_a_host() -> None:
    cfg = config(worker=VERIFIERS_WORKER)
    assert cfg.worker.verifiers.taskset == "flywheel-arithmetic" and cfg.worker.verifiers.harness == "null"
    assert cfg.worker.verifiers.python is None  # the adapter's default: .venv-verifiers beside the controller's
    assert config(worker={**VERIFIERS_WORKER, "verifiers": {"url": "http://127.0.0.1:9000"}}).worker.verifiers.url


@pytest.mark.parametrize("worker_section, message", [
    ({"type": "verifiers"}, "needs its environment"),
    ({**VERIFIERS_WORKER, "type": "math"}, "only the verifiers worker"),
    ({**VERIFIERS_WORKER, "verifiers": {"harness": "null"}}, "name the taskset"),
    ({**VERIFIERS_WORKER, "verifiers": {"url": "ftp://x"}}, r"must be an http\(s\) URL"),
    ({**VERIFIERS_WORKER, "system_prompt": "be brief"}, "are the taskset's"),
    ({**VERIFIERS_WORKER, "instruction": "think"}, "are the taskset's"),
    ({**VERIFIERS_WORKER, "verifiers": {"taskset": "x", "runtime": "docker"}}, "runtime"),
])
def test_what_the_verifiers_worker_does_not_use_is_refused(worker_section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(worker=worker_section)


def test_the_reward_section_is_refused_beside_the_environments_reward() -> None:
    with pytest.raises(ConfigError, match="the environment's reward"):
        config(worker=VERIFIERS_WORKER, reward={"name": "math"})


def test_a_worker_of_your_own_must_be_a_verifiers_worker_to_take_one() -> None:
    from services.controller.assemble import build_pipeline
    from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, simulated_services

    cfg = config(worker={**VERIFIERS_WORKER, "type": "services.controller.workers:SimpleRolloutWorker"})
    with pytest.raises(ConfigError, match="not a verifiers worker"):
        build_pipeline(cfg, simulated_services(SimulatedTrainer(), [SimulatedRolloutEngine()]))


async def test_a_run_starts_the_environment_first_and_closes_it_at_the_end() -> None:
    from services.controller.assemble import build_pipeline
    from services.controller.loop import run
    from services.controller.testing.simulated import SimulatedTrainer, simulated_services

    fake = FakeRollout()
    fake.version = 0  # fully-async: this replica follows no synchronizer
    env = SimulatedVerifiers(fake)
    services = simulated_services(SimulatedTrainer(), [FakeReplica(fake)])
    services.verifiers = env
    cfg = config(worker={**VERIFIERS_WORKER, "group_size": 2, "max_in_flight": 2}, algorithm={"train_batch_size": 4},
                 run={"max_steps": 2}, mode="fully-async")
    p = build_pipeline(cfg, services, retry_backoff_seconds=0.01)
    summary = await run(p)
    assert summary.steps == 2 and env.started and env.closed
    assert p.memory.latest()["rollout/reward_mean"] == 0.5  # the environment's reward was trained
