"""`VerifiersWorker` (worker.type verifiers): episodes of a verifiers environment, played against
the run's rollout replicas as the environment's OpenAI endpoint.

verifiers (0.4, `verifiers.v1`) is where prime-rl's and the Tinker cookbook's environments are
written: a taskset (the tasks, their rewards, when an episode stops) and a harness (the program
the model runs in). Its episodes run in the verifiers host (adapters/verifiers_host.py), a
process in verifiers' own virtual environment (worker.verifiers).

Each episode is the external worker's (workers/external.py), with the host as the agent:
1. a session is opened on a replica, and its base URL and key are the endpoint the environment's
   harness calls (session-scoped: the replica records every call's tokens);
2. the host plays the task (the run's data row, validated into the taskset's TaskData) with the
   run's sampling (worker.sampling; validation's for held-out tasks), within
   `worker.agent_timeout_seconds`;
3. what is trained is rebuilt from the session's records, so the trained tokens are the sampled
   ones; the reward is the environment's, and its named rewards and metrics (as `env_<name>`)
   and turns (`env_turns`) are the trajectory's scores (a reward named `accuracy` is the run's
   val/accuracy).

An episode verifiers did not finish cleanly (a model call that failed, a reward that raised or did
not run, a stage past its deadline) fails its task with verifiers' errors, and is never trained
as a reward of 0; an aborted model call (a weight update) or a lost session retries it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from services.controller.domain import SamplingSpec, Task
from services.controller.rollouts.episodes import OpenedSession
from services.controller.workers.base import WorkerContext
from services.controller.workers.external import AgentFailed, ExternalAgentWorker, Played, task_dict


@dataclass
class EpisodePlayed:
    """The host's account of one episode: `ok` when verifiers finished it with every reward scored."""

    ok: bool
    reward: float | None
    scores: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class VerifiersEnvironment(Protocol):
    async def start(self) -> None: ...

    async def play(self, task: dict[str, Any], base_url: str, api_key: str, sampling: dict[str, Any],
                   timeout_seconds: float) -> EpisodePlayed: ...

    async def close(self) -> None: ...


def sampling_body(sampling: SamplingSpec | None) -> dict[str, Any]:
    """The sampling the environment's harness asks the endpoint for, in chat-completions terms."""
    if sampling is None:
        return {}
    body: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                            "max_tokens": sampling.max_tokens}
    if sampling.top_k and sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


class VerifiersWorker(ExternalAgentWorker):
    def _require(self, ctx: WorkerContext) -> None:
        if ctx.verifiers is None:
            raise ValueError("the verifiers worker needs its environment (worker.verifiers: a taskset, or the url "
                             "of a verifiers host)")

    async def start(self) -> None:
        await self.ctx.verifiers.start()

    async def close(self) -> None:
        await self.ctx.verifiers.close()

    async def play(self, task: Task, session: OpenedSession, sampling: SamplingSpec | None) -> Played:
        played = await self.ctx.verifiers.play(task_dict(task), session.base_url, session.key,
                                               sampling_body(sampling), self.ctx.agent_timeout_seconds)
        if not played.ok:
            self.stats["environment_errors"] += 1
            raise AgentFailed("the environment's episode failed: " + ("; ".join(played.errors) or "no reward"))
        return Played(played.reward, played.scores)
