"""The rollout worker interface and what every worker shares.

A worker turns one `Task` into a `RolloutOutcome`: `n` scored trajectories
(one GRPO group) and a status:
- SUCCESS: every trajectory generated and scored;
- RE_ROLLOUT: the engine aborted a request (e.g. a weight update in ABORT
  mode) or no replica answered: the task goes back to the front of the
  loader and is retried, never lost;
- FAIL: a reward raised, or the engine reported an error: the errors are
  recorded on the trajectories and the task is given up.

Write your own by subclassing `RolloutWorker` and implementing `rollout`;
name it in the config as `worker.type: "package.module:MyWorker"`. Workers
are async and hold no per-task state, so one instance serves every task in
flight.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.errors import Aborted, DeadlineExceeded, Unavailable
from services.controller.rollouts.balancer import EnginePool
from services.controller.domain import (
    GENERATION_DONE,
    FinishReason,
    Generation,
    PromptInput,
    RolloutOutcome,
    RolloutStatus,
    SamplingSpec,
    Task,
    Trajectory,
    TrajectoryStatus,
)
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.tasks.rewards import RewardError, RewardFn, score


@dataclass
class WorkerContext:
    """Everything a worker may use; built once per run from the config."""

    engines: EnginePool
    reward: RewardFn
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    model_tag: str = "default"
    #: Send text prompts as chat messages (chat template applied by the engine).
    chat: bool = True
    system_prompt: str | None = None
    #: Text a worker appends to each question; None: the worker's own default.
    instruction: str | None = None
    max_turns: int = 4
    #: Agent workers: the tools and how their results are rendered.
    tools: Any = None
    tool_result_template: str | None = None
    #: External worker: the user's agent, called as agent(task, base_url, api_key, session_id)
    #: (services/controller/workers/external.py `load_agent`), its limit per episode, and
    #: how long a replica keeps a session's records.
    agent: Any = None
    agent_timeout_seconds: float = 300.0
    session_ttl_seconds: float | None = None
    #: Where a worker records what its outcome does not carry (e.g. a retried episode's cause).
    errors: ErrorReporter | None = None
    #: Environment worker: how a session on the environment server is opened (workers/environment.py's
    #: OpenSession), and the server's settings (worker.env).
    environment: Any = None
    environment_config: Any = None
    #: Verifiers worker: the verifiers environment its episodes are played in (workers/verifiers.py's
    #: VerifiersEnvironment; adapters/verifiers_env.py's host, or a simulated one in tests).
    verifiers: Any = None


class RolloutWorker(ABC):
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        #: Counts a worker keeps of its own (reported as `worker/<name>_total` metrics).
        self.stats: Counter[str] = Counter()

    @abstractmethod
    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        """n trajectories of `task`, scored, with a status."""

    async def start(self) -> None:
        """Called once as the run starts, before any rollout: starts what the worker's episodes need."""

    async def close(self) -> None:
        """Called once as the run ends: stops what `start` started."""

    # -- helpers shared by the built-in workers ----------------------------
    def messages_for(self, task: Task) -> list[dict[str, Any]]:
        if isinstance(task.prompt, list):
            messages = [dict(m) for m in task.prompt]
        else:
            messages = [{"role": "user", "content": self.format_prompt(task)}]
        if self.ctx.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.ctx.system_prompt})
        return messages

    def format_prompt(self, task: Task) -> str:
        """The prompt text of a text task (subclasses add instructions)."""
        return str(task.prompt)

    def prompt_input(self, task: Task) -> PromptInput:
        if self.ctx.chat or isinstance(task.prompt, list):
            return PromptInput(request_id=task.id, messages=self.messages_for(task))
        return PromptInput(request_id=task.id, text=self.format_prompt(task))

    def trajectory(self, task: Task, g: Generation, index: int) -> Trajectory:
        return Trajectory(
            task=task,
            prompt_ids=list(g.prompt_token_ids),
            response_ids=list(g.completion_token_ids),
            response_logprobs=list(g.completion_logprobs),
            response_mask=[1] * len(g.completion_token_ids),
            version_start=g.version_start,
            version_end=g.version_end,
            engine=g.engine,
            finish_reason=g.finish_reason,
            text=g.text,
            sample_index=index,
            model_tag=self.ctx.model_tag,
            distribution=g.distribution,
            version_spans=list(g.version_spans),
            kept_sets=list(g.kept_sets),
            routed_experts=g.routed_experts,
        )

    async def score_all(self, task: Task, trajectories: list[Trajectory]) -> RolloutOutcome:
        """Scores every trajectory, together (a remote judge's calls overlap); a reward that raises fails
        only its trajectory. Generation is over by now: the task's generation slot goes to the next task."""
        if (generation_done := GENERATION_DONE.get()) is not None:
            generation_done()

        async def one(t: Trajectory) -> str | None:
            try:
                t.reward, t.scores = await score(self.ctx.reward, task, t.text, **self.ctx.reward_kwargs)
            except RewardError as exc:
                t.status, t.error = TrajectoryStatus.FAILED, f"reward: {exc}"
                return f"sample {t.sample_index}: {t.error}"
            return None

        errors = [e for e in await asyncio.gather(*(one(t) for t in trajectories)) if e is not None]
        if errors:
            return RolloutOutcome(RolloutStatus.FAIL, trajectories, error="; ".join(errors))
        return RolloutOutcome(RolloutStatus.SUCCESS, trajectories)


def check_generations(generations: list[Generation]) -> RolloutOutcome | None:
    """The outcome forced by aborted or failed generations, if any."""
    if any(g.finish_reason == FinishReason.ABORT for g in generations):
        return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error="generation aborted")
    if any(g.finish_reason == FinishReason.ERROR for g in generations):
        return RolloutOutcome(RolloutStatus.FAIL, error="the engine reported an error for a generation")
    return None


#: Engine errors that mean "try this task again later", not "this task is bad".
#: (Aborted: a replica could not get the weights the step needs in time.)
RETRYABLE = (Unavailable, DeadlineExceeded, Aborted)
