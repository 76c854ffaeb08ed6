"""`ExternalAgentWorker`: trains an unmodified agent, code that talks to the
model only through the official `openai` SDK.

The agent is named by `worker.agent`:
- "package.module:function" or "path/to/file.py:function": called as
  `function(task, base_url, api_key)`; async functions are awaited, sync
  ones run in a thread;
- "http(s)://...": the user's agent service, POSTed
  `{"task", "base_url", "api_key", "session_id"}` and answering `{"reward"}`.
`task` is a dict with id, prompt, answer and data (the whole dataset row).

Each of a task's n episodes, concurrently:
1. opens a session on a replica (healthy, least loaded; the episode stays on
   it), its metadata naming the task, the run step and the least weight
   version, so the replica can pace the session's calls like a Generate;
2. runs the agent against the session's base URL and key, within
   `agent_timeout_seconds`;
3. reads the session's records and rebuilds the episode from their token ids
   (`services/controller/rollouts/episodes.py`: of several segments the last is
   trained, the others are counted as dropped);
4. deletes the session, whatever happened.

The reward is the number the agent returned; else the one it posted with the
session's `finish`; else the run's reward function on the final assistant
text. (`play` is what runs the agent: the verifiers worker, workers/verifiers.py,
plays a verifiers environment there instead, with its reward and scores.) Sampling is the agent's own (the arguments it passes the SDK):
`worker.sampling` and validation's sampling do not apply.

A task is trained only when all of its episodes are clean. Otherwise:
- FAIL (recorded with the agent's traceback by the rollout manager, the task
  given up): the agent raised, it never called the model, it returned
  something that is not a number, the engine reported an error for a call,
  the records are malformed, the reward function raised. Running the same
  agent code again would most likely meet the same bug.
- RE_ROLLOUT (the task is retried, up to worker.max_retries): the agent ran
  out of time, a call was aborted (even if the agent then raised or returned
  no reward: it gave up on the abort), the session was lost (the replica
  restarted or the session expired), no replica answered. These are
  transient: a replica waiting for the weights its step needs can hold an
  agent past its limit. A sync agent that timed out keeps running in its
  thread; its session is deleted, so its later calls fail.
When a task's episodes disagree, FAIL wins.

`stats` counts episodes, agent_errors, agent_timeouts, agent_no_calls,
sessions_lost and dropped_segments (reported as `worker/<name>_total`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import math
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.errors import FailedPrecondition, ResourceExhausted
from services.controller.rollouts.balancer import Replica
from services.controller.domain import (
    MIN_WEIGHT_VERSION,
    RUN_STEP,
    RolloutOutcome,
    RolloutStatus,
    SamplingSpec,
    Task,
    Trajectory,
)
from services.controller.rollouts.episodes import OpenedSession, SessionLost, rebuild, trajectory
from services.controller.protocols import AgentSessions, RolloutEngine
from services.controller.tasks.rewards import RewardError, import_object, score
from services.controller.workers.base import RETRYABLE, RolloutWorker, WorkerContext

log = logging.getLogger(__name__)

#: agent(task, base_url, api_key, session_id) -> the reward, or None.
Agent = Callable[[dict[str, Any], str, str, str], Awaitable[Any]]

#: A session outlives its agent's limit by this much by default, so its records are still
#: there when the controller reads them.
SESSION_GRACE_SECONDS = 60.0
#: Most sync agents running at once (threads are started only as needed).
AGENT_THREADS = 256


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def load_agent(spec: str) -> Agent:
    """The agent named by `spec`: an http(s) URL of an agent service, 'package.module:function',
    or 'path/to/file.py:function' (relative to the working directory)."""
    if spec.startswith(("http://", "https://")):
        from services.controller.adapters.sessions import AgentService

        return AgentService(spec)
    where, _, name = spec.rpartition(":")
    fn = _function_in_file(Path(where), name) if where.endswith(".py") else import_object(spec)
    if not callable(fn):
        raise ValueError(f"agent {spec!r} is not callable")
    return python_agent(fn)


def _function_in_file(path: Path, name: str) -> Any:
    if not path.is_file():
        raise ValueError(f"no file {path} (a relative path is taken from {Path.cwd()})")
    spec = importlib.util.spec_from_file_location(f"flywheel_agent_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise ValueError(f"{path} has no attribute {name!r}")
    return getattr(module, name)


def python_agent(fn: Callable[..., Any]) -> Agent:
    """A Python agent `fn(task, base_url, api_key)` as an Agent: awaited when async, else run in a thread."""
    # Threads of their own: the loop's default pool has a few per core, and episodes queued
    # behind others there would spend their time limit waiting.
    threads = ThreadPoolExecutor(max_workers=AGENT_THREADS, thread_name_prefix="agent")

    async def agent(task: dict[str, Any], base_url: str, api_key: str, session_id: str) -> Any:
        if _is_async(fn):
            return await fn(task, base_url, api_key)
        result = await asyncio.get_running_loop().run_in_executor(threads, fn, task, base_url, api_key)
        return await result if inspect.isawaitable(result) else result

    return agent


class AgentFailed(Exception):
    """The agent (or the environment it stands for) ended the episode without a reward: the message says why."""


@dataclass
class Played:
    """What an episode's agent answered: its reward (None: the session's, else the reward function's), and
    scores of its own beside it."""

    reward: float | None
    scores: dict[str, float]


def task_dict(task: Task) -> dict[str, Any]:
    """What the agent is given of a task."""
    prompt = [dict(m) for m in task.prompt] if isinstance(task.prompt, list) else task.prompt
    return {"id": task.id, "prompt": prompt, "answer": task.answer, "data": dict(task.data)}


def _retry(error: str) -> RolloutOutcome:
    return RolloutOutcome(RolloutStatus.RE_ROLLOUT, error=error)


def _fail(error: str, trace: str | None = None) -> RolloutOutcome:
    return RolloutOutcome(RolloutStatus.FAIL, error=error, traceback=trace)


class ExternalAgentWorker(RolloutWorker):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self._require(ctx)
        self.ttl_seconds = ctx.session_ttl_seconds or ctx.agent_timeout_seconds + SESSION_GRACE_SECONDS
        # httpx logs every request at INFO: the session calls, three per episode, would bury the
        # run's log. Left alone if someone set its level.
        httpx_log = logging.getLogger("httpx")
        if httpx_log.level == logging.NOTSET:
            httpx_log.setLevel(logging.WARNING)

    def _require(self, ctx: WorkerContext) -> None:
        if ctx.agent is None:
            raise ValueError("the external worker needs an agent (worker.agent: 'package.module:function', "
                             "'path/to/file.py:function' or an http(s) URL)")

    async def rollout(self, task: Task, n: int, sampling: SamplingSpec) -> RolloutOutcome:
        outcomes = await asyncio.gather(*(self.episode(task, i, sampling) for i in range(n)))
        for status in (RolloutStatus.FAIL, RolloutStatus.RE_ROLLOUT):
            bad = [(i, o) for i, o in enumerate(outcomes) if o.status == status]
            if bad:
                error = "; ".join(f"sample {i}: {o.error}" for i, o in bad)
                trace = next((o.traceback for _, o in bad if o.traceback), None)
                return RolloutOutcome(status, error=error, traceback=trace)
        return RolloutOutcome(RolloutStatus.SUCCESS, [o.trajectories[0] for o in outcomes])

    async def episode(self, task: Task, index: int, sampling: SamplingSpec | None = None) -> RolloutOutcome:
        """One episode on one session; an outcome with its one trajectory when clean."""
        metadata = {
            "task_id": task.id, "sample_index": str(index),
            "run_step": str(RUN_STEP.get()), "min_weight_version": str(MIN_WEIGHT_VERSION.get()),
        }
        try:
            (sessions, session), replica = await self.ctx.engines.call(lambda e: self._open(e, metadata))
        except (*RETRYABLE, ResourceExhausted) as exc:
            return _retry(f"no session opened: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a replica without sessions, a contract mismatch: retrying will not help
            return _fail(f"no session opened: {type(exc).__name__}: {exc}")
        self.stats["episodes"] += 1
        with self.ctx.engines.occupied(replica):
            try:
                return await self._run(task, index, sessions, session, replica, sampling)
            finally:
                await self._delete(sessions, session)

    async def _open(self, engine: RolloutEngine, metadata: dict[str, str]) -> tuple[AgentSessions, OpenedSession]:
        if not hasattr(engine, "sessions"):
            raise FailedPrecondition(f"rollout replica {engine.name} ({type(engine).__name__}) serves no agent sessions")
        sessions = await engine.sessions()
        return sessions, await sessions.open(ttl_seconds=self.ttl_seconds, metadata=metadata)

    async def _delete(self, sessions: AgentSessions, session: OpenedSession) -> None:
        try:
            await sessions.delete(session.id)
        except Exception as exc:  # the replica forgets it at its TTL anyway
            log.warning("session %s not deleted: %s: %s", session.id, type(exc).__name__, exc)

    async def play(self, task: Task, session: OpenedSession, sampling: SamplingSpec | None) -> Played:
        """Runs the agent on the episode's session: its reward (None: the session's, else the reward
        function's) and scores of its own. Raises `AgentFailed` when the agent's answer is no reward."""
        returned = await self.ctx.agent(task_dict(task), session.base_url, session.key, session.id)
        if returned is not None and (isinstance(returned, bool) or not isinstance(returned, (int, float))):
            raise AgentFailed(f"the agent returned a {type(returned).__name__}; return a number (the reward) or None")
        return Played(returned, {})

    async def _run(
        self, task: Task, index: int, sessions: AgentSessions, session: OpenedSession, replica: Replica,
        sampling: SamplingSpec | None = None,
    ) -> RolloutOutcome:
        limit = self.ctx.agent_timeout_seconds
        try:
            async with asyncio.timeout(limit) as deadline:
                played = await self.play(task, session, sampling)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                self._count("agent_timeouts", f"the agent ran past its limit of {limit:g}s", task, index)
                return _retry(f"the agent ran past its limit of {limit:g}s")
            if await self._aborted(sessions, session):
                # The engine aborted a call (a weight update), and the agent gave up on that: worth a retry.
                return _retry(f"a model call of the episode was aborted, and then {type(exc).__name__}: {exc}")
            self.stats["agent_errors"] += 1
            if isinstance(exc, AgentFailed):
                return _fail(str(exc))
            return _fail(f"the agent raised {type(exc).__name__}: {exc}", traceback.format_exc())

        try:
            record = await sessions.read(session.id)
        except SessionLost as exc:
            self._count("sessions_lost", str(exc), task, index)
            return _retry(str(exc))
        except (*RETRYABLE, ResourceExhausted) as exc:
            return _retry(f"session records not read: {type(exc).__name__}: {exc}")
        except Exception as exc:
            return _fail(f"session records not read: {type(exc).__name__}: {exc}")
        if not record.calls:
            self.stats["agent_no_calls"] += 1
            return _fail("the agent never called the model")
        try:
            episode = rebuild(record.calls)
        except ValueError as exc:
            return _fail(f"session records are malformed: {exc}")
        if episode.aborted:
            return _retry("a model call of the episode was aborted")
        if episode.failed:
            return _fail("the engine reported an error for a model call of the episode")
        if episode.dropped_segments:
            self.stats["dropped_segments"] += episode.dropped_segments
            log.info(
                "task %s sample %d: %d of %d segments dropped (the agent's history did not extend the previous "
                "call's); training on the last", task.id, index, episode.dropped_segments, len(episode.segments),
            )
        assert episode.trained is not None  # there were calls
        t = trajectory(episode.trained, task, sample_index=index, model_tag=self.ctx.model_tag, engine=replica.name)
        reward = played.reward if played.reward is not None else record.reward
        return await self._scored(t, reward, played.scores)

    async def _aborted(self, sessions: AgentSessions, session: OpenedSession) -> bool:
        """Whether the engine aborted one of the session's calls (False when the records cannot be read)."""
        try:
            record = await sessions.read(session.id)
            return bool(record.calls) and rebuild(record.calls).aborted
        except Exception:  # noqa: BLE001 - the agent's own error is the one reported then
            return False

    async def _scored(self, t: Trajectory, reward: float | None, scores: dict[str, float]) -> RolloutOutcome:
        if reward is None:
            try:
                t.reward, t.scores = await score(self.ctx.reward, t.task, t.text, **self.ctx.reward_kwargs)
            except RewardError as exc:
                return _fail(f"reward: {exc}")
        elif not math.isfinite(reward):  # it would poison the group's advantages
            return _fail(f"the agent's reward is {reward}")
        else:
            t.reward, t.scores = float(reward), {"reward": float(reward), **scores}
        return RolloutOutcome(RolloutStatus.SUCCESS, [t])

    def _count(self, what: str, message: str, task: Task, index: int) -> None:
        """Counts an episode that is retried, and records why (a retried task is not recorded otherwise)."""
        self.stats[what] += 1
        if self.ctx.errors is not None:
            self.ctx.errors.report(
                "external_agent", message, severity="warning", context={"task": task.id, "sample": index}
            )
        else:
            log.warning("task %s sample %d: %s", task.id, index, message)
