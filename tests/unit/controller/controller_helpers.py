"""Builders shared by the controller's unit tests: configs, trajectories and
simulated pipelines run in virtual time (no real waiting)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from flywheel.runtime.config import deep_merge
from services.controller.assemble import build_pipeline
from services.controller.domain import FinishReason, Task, Trajectory
from services.controller.loop import run
from services.controller.pipeline import Pipeline
from services.controller.run_config import RunConfig, parse_run_config
from services.controller.testing.simulated import (
    SimulatedRolloutEngine,
    SimulatedTrainer,
    constant,
    lognormal,
    normal,
    run_virtual,
    simulated_services,
)


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
    return parse_run_config(deep_merge(data, overrides))


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


#: The knobs of a whole simulated run whose staleness is checked (hypothesis strategies).
STALENESS_RUN = dict(
    threshold=st.integers(0, 3),
    group=st.sampled_from([1, 2, 4]),
    groups_per_batch=st.integers(1, 4),
    in_flight=st.integers(1, 12),
    gen_sigma=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    train_mean=st.sampled_from([0.01, 0.05, 0.2]),
    pause_mode=st.sampled_from(["keep", "wait", "abort"]),
    replicas=st.integers(1, 3),
    abort=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 10_000),
)


def staleness_run(
    mode: str, threshold: int, group: int, groups_per_batch: int, in_flight: int, gen_sigma: float,
    train_mean: float, pause_mode: str, replicas: int, abort: float, seed: int, steps: int = 6, *,
    policy: str | None = None, algorithm: str | None = None,
) -> tuple[Pipeline, SimulatedTrainer]:
    """A whole simulated run of `steps` steps with STALENESS_RUN's knobs (`policy`: staleness.policy,
    `algorithm`: algorithm.name; None: the defaults); checks that it ran every step and trained no
    task twice."""
    cfg = config(
        mode=mode,
        staleness={"threshold": threshold, **({"policy": policy} if policy else {})},
        worker={"group_size": group, "max_in_flight": in_flight, "max_retries": 50},
        algorithm={"train_batch_size": group * groups_per_batch, **({"name": algorithm} if algorithm else {})},
        data={"train": {"items": items(400)}},
        sync={"pause_mode": pause_mode},
        run={"max_steps": steps, "seed": seed},
    )
    p, trainer, _ = simulated_pipeline(
        cfg, seed=seed, gen_sigma=gen_sigma, train_mean=train_mean, replicas=replicas, abort_probability=abort
    )
    summary = run_virtual(run(p))
    assert summary.steps == steps, summary.stop_reason
    trained_tasks = [t for record in p.train_worker.history for t in record.task_ids]
    assert len(trained_tasks) == len(set(trained_tasks)) * group  # no task trained twice
    return p, trainer
