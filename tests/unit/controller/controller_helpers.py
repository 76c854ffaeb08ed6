"""Builders shared by the controller's unit tests: configs, trajectories and
simulated pipelines run in virtual time (no real waiting)."""

from __future__ import annotations

import random
from typing import Any

from services.controller.assemble import build_pipeline
from services.controller.domain import FinishReason, Task, Trajectory
from services.controller.pipeline import Pipeline
from services.controller.run_config import RunConfig, parse_run_config
from services.controller.testing.simulated import (
    SimulatedRolloutEngine,
    SimulatedTrainer,
    constant,
    lognormal,
    normal,
    simulated_services,
)


def deep_update(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


def items(n: int = 64, answers: int = 4) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}", "answer": str(i % answers)} for i in range(n)]


def config(**overrides: Any) -> RunConfig:
    data: dict[str, Any] = {
        "data": {"train": {"items": items()}},
        "worker": {"type": "math", "group_size": 4, "max_in_flight": 8},
        "algorithm": {"train_batch_size": 8},
        "checkpoint": {"at_end": False},
        "metrics": {"jsonl": False},
    }
    return parse_run_config(deep_update(data, overrides))


def task(i: int = 0, answer: Any = "1") -> Task:
    return Task(id=f"train:0:{i}", index=i, epoch=0, prompt=f"question {i}", answer=answer)


def trajectory(
    t: Task | None = None, reward: float = 0.0, version: int = 0, *, response: int = 3, index: int = 0,
    finish: FinishReason = FinishReason.STOP, **keys: Any,
) -> Trajectory:
    t = t or task()
    return Trajectory(
        task=t, prompt_ids=[5, 6, 7], response_ids=list(range(10, 10 + response)),
        response_logprobs=[-0.5] * response, response_mask=[1] * response,
        version_start=version, version_end=version, finish_reason=finish, reward=reward,
        scores={"reward": reward}, sample_index=index, keys=dict(keys),
    )


def simulated_pipeline(
    cfg: RunConfig,
    *,
    seed: int = 0,
    gen_mean: float = 0.05,
    gen_sigma: float = 1.0,
    train_mean: float = 0.05,
    replicas: int = 1,
    abort_probability: float = 0.0,
    update_time: float = 0.001,
    text=None,
    synchronizer=None,
    probes=(),
    trainer: SimulatedTrainer | None = None,
) -> tuple[Pipeline, SimulatedTrainer, list[SimulatedRolloutEngine]]:
    """`trainer`: an existing simulated trainer (a run resumed on the same trainer service)."""
    rng = random.Random(seed)
    trainer = trainer or SimulatedTrainer(train_time=normal(train_mean, 0.1, rng), export_time=constant(0.001))
    engines = []
    for i in range(replicas):
        engine = SimulatedRolloutEngine(
            name=f"sim-{i}", gen_time=lognormal(gen_mean, gen_sigma, rng) if gen_sigma else constant(gen_mean),
            update_time=constant(update_time), rng=random.Random(seed * 100 + i), abort_probability=abort_probability,
        )
        if text is not None:
            engine.text = text
        engines.append(engine)
    services = simulated_services(trainer, engines, synchronizer, probes)
    pipeline = build_pipeline(cfg, services, keep_history=True, retry_backoff_seconds=0.01)
    return pipeline, trainer, engines
