"""Rollout workers: task -> scored trajectories. Built-ins by name, or your own
as 'module:Class' (a `RolloutWorker` subclass)."""

from __future__ import annotations

from services.controller.workers.agent import AgentRolloutWorker
from services.controller.workers.base import RolloutWorker, WorkerContext
from services.controller.workers.environment import EnvironmentWorker
from services.controller.workers.external import ExternalAgentWorker
from services.controller.workers.math import SingleTurnMathWorker
from services.controller.workers.simple import SimpleRolloutWorker
from services.controller.workers.verifiers import VerifiersWorker

BUILTIN_WORKERS: dict[str, type[RolloutWorker]] = {
    "simple": SimpleRolloutWorker,
    "math": SingleTurnMathWorker,
    "agent": AgentRolloutWorker,
    "external": ExternalAgentWorker,
    "openenv": EnvironmentWorker,
    "verifiers": VerifiersWorker,
}


def worker_class(name: str) -> type[RolloutWorker]:
    if name in BUILTIN_WORKERS:
        return BUILTIN_WORKERS[name]
    from services.controller.tasks.rewards import import_object

    cls = import_object(name)
    if not (isinstance(cls, type) and issubclass(cls, RolloutWorker)):
        raise ValueError(f"worker {name!r} is not a RolloutWorker subclass")
    return cls


__all__ = [
    "AgentRolloutWorker",
    "BUILTIN_WORKERS",
    "EnvironmentWorker",
    "ExternalAgentWorker",
    "RolloutWorker",
    "SimpleRolloutWorker",
    "SingleTurnMathWorker",
    "VerifiersWorker",
    "WorkerContext",
    "worker_class",
]
