"""The weight-sync controller per mode and method, and validation."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.activity import ActivityTracker
from services.controller.balancer import EnginePool
from services.controller.domain import TrainResult
from services.controller.errors_report import ErrorReporter
from services.controller.loop import run
from services.controller.simulated import (
    SimulatedRolloutEngine,
    SimulatedSynchronizer,
    SimulatedTrainer,
    constant,
    run_virtual,
)
from services.controller.staleness import StalenessGate
from services.controller.weight_sync import SyncPolicy, WeightSyncController
from tests.unit.controller.controller_helpers import config, items, simulated_pipeline


def controller(mode: str, method: str = "checkpoint", replicas: int = 2, update_time: float = 0.5, **kw):
    trainer = SimulatedTrainer(export_time=constant(0.1))
    engines = EnginePool([SimulatedRolloutEngine(name=f"r{i}", update_time=constant(update_time)) for i in range(replicas)])
    gate = StalenessGate(4, {"sync": 0, "batch-async": 1}.get(mode))
    tracker, errors = ActivityTracker(), ErrorReporter()
    events = []
    sync = WeightSyncController(
        trainer, engines, gate, tracker, errors, mode=mode, method=method,
        pause_rollouts=lambda: events.append("pause"), resume_rollouts=lambda: events.append("resume"), **kw,
    )
    return sync, trainer, engines, gate, tracker, errors, events


def test_sync_mode_pauses_waits_for_quiescence_and_moves_every_replica() -> None:
    async def scenario() -> None:
        sync, trainer, engines, gate, tracker, _, events = controller("sync")
        token = tracker.begin("rollout", "late")
        asyncio.get_running_loop().call_later(1.0, tracker.end, token)
        trainer.version = 1
        started = asyncio.get_running_loop().time()
        await sync.after_step(TrainResult(step=1, version=1, tokens=0))
        # Waited for the in-flight rollout (1 s), exported (0.1 s), then both replicas loaded (0.5 s, together).
        assert asyncio.get_running_loop().time() - started == pytest.approx(1.6)
        assert events == ["pause", "resume"]
        assert [r.version for r in engines.replicas] == [1, 1] and gate.rollout_version == 1

    run_virtual(scenario())


def test_async_modes_export_then_load_in_the_background_and_coalesce() -> None:
    async def scenario() -> None:
        sync, trainer, engines, gate, tracker, _, events = controller("fully-async")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await sync.after_step(TrainResult(1, 1, 0))
        assert loop.time() - started == pytest.approx(0.1)  # only the export was awaited
        assert events == [] and engines.min_version() == 0
        await asyncio.sleep(0.2)
        await sync.after_step(TrainResult(2, 2, 0))  # arrives while version 1 is loading
        await asyncio.sleep(2.0)
        assert [r.version for r in engines.replicas] == [2, 2] and gate.rollout_version == 2
        assert sync.transfers == 4  # v1 to both, then straight to v2 (no v1.5 queue)
        await sync.close()

    run_virtual(scenario())


def test_a_failed_update_takes_the_replica_out_until_it_recovers() -> None:
    async def scenario() -> None:
        sync, trainer, engines, gate, tracker, errors, _ = controller("batch-async")
        engines.replica("r1").engine.down = True
        await sync.after_step(TrainResult(1, 1, 0))
        await asyncio.sleep(1.0)
        assert not engines.replica("r1").healthy and errors.records[-1].context == {"replica": "r1", "version": 1}
        assert errors.records[-1].severity == "error" and gate.rollout_version == 1  # r0 alone is the floor
        engines.replica("r1").engine.down = False
        engines.mark("r1", True)
        sync.replica_recovered("r1")
        await asyncio.sleep(1.0)
        assert engines.replica("r1").version == 1
        await sync.close()

    run_virtual(scenario())


def test_the_local_fixed_policy_without_a_synchronizer() -> None:
    assert [s for s in range(1, 10) if SyncPolicy(interval=3, offset=1).need(s)] == [4, 7]


@pytest.mark.parametrize(("mode", "wait", "limit"), [("sync", 0, 0), ("batch-async", 1, 1), ("fully-async", 0, None)])
def test_with_a_synchronizer_the_controller_moves_no_weights(mode: str, wait: int, limit) -> None:
    async def scenario() -> None:
        synchronizer = SimulatedSynchronizer()
        sync, trainer, engines, gate, *_ = controller(mode, synchronizer=synchronizer, policy=SyncPolicy(2, 1))
        await sync.configure()
        assert synchronizer.configured == {"style": "fixed", "method": "checkpoint", "interval": 2, "offset": 1,
                                           "timeout_seconds": 120.0, "mode": mode, "max_staleness": wait}
        assert gate.limit == limit
        for step in (1, 2, 3):
            trainer.version = step
            await sync.after_step(TrainResult(step, step, 0))
            # The trainer published whatever was due; replicas follow by themselves.
            assert trainer.exports == 0 and engines.min_version() == 0
            assert gate.rollout_version == step  # the next batch may be dispatched
        # A version outside the schedule that the run must measure (validation, a resume) is
        # published once, and only if the synchronizer does not hold it yet.
        await sync.settle(3)
        assert trainer.exports == 1 and engines.min_version() == 0
        synchronizer.latest = 3
        await sync.settle(3)
        await sync.bring_up_to(3)
        assert trainer.exports == 1

        nccl, trainer, engines, *_ = controller(mode, method="nccl", synchronizer=SimulatedSynchronizer())
        trainer.version = 1
        await nccl.settle(1)  # a group of every registered replica; they join on their own
        assert nccl.synchronizer.groups == 1 and trainer.exports == 1
        # After a rewind to 1 the synchronizer still lists 1, but replicas going back to it cannot
        # pull an NCCL version: it is broadcast again (a MEMORY or CHECKPOINT one is not).
        nccl.synchronizer.latest = 1
        await nccl.publish(1, again=True)
        assert nccl.synchronizer.groups == 2 and trainer.exports == 2
        await sync.publish(3, again=True)
        assert sync.trainer.exports == 1

    run_virtual(scenario())


@pytest.mark.parametrize("mode", ["sync", "batch-async", "fully-async"])
def test_validation_every_interval_versions_and_before_training(mode: str) -> None:
    val_items = [{"prompt": f"question {i}", "answer": "1"} for i in range(6)]
    cfg = config(
        mode=mode,
        run={"max_steps": 4},
        data={"train": {"items": items(200)}, "validation": {"items": val_items, "shuffle": False}},
        validation={"interval": 2, "before_training": True},
    )
    p, _, engines = simulated_pipeline(cfg, text=lambda prompt, rng: "\\boxed{1}")
    run_virtual(run(p))
    versions = [v for v, _ in p.validator.history]
    assert versions == [0, 2, 4]
    metrics = p.validator.history[-1][1]
    assert metrics["val/accuracy"] == 1.0 and metrics["val/reward"] == 1.0 and metrics["val/samples"] == 6
    val_steps = [m for _, _, m in p.memory.steps if "val/reward" in m]
    assert len(val_steps) == 3
    assert not p.rollouts.paused  # training rollouts resumed after each validation


@pytest.mark.parametrize("mode", ["sync", "batch-async", "fully-async"])
def test_validation_runs_on_the_weights_it_names_and_the_last_version_is_validated(mode: str) -> None:
    """Replica updates take longer than training steps: async modes must let the
    background update land before validating, and the run's last version is
    validated even when the interval does not land on it."""
    val_items = [{"prompt": f"question {i}", "answer": "1"} for i in range(4)]
    cfg = config(
        mode=mode,
        run={"max_steps": 5},
        data={"train": {"items": items(200)}, "validation": {"items": val_items, "shuffle": False}},
        validation={"interval": 2, "before_training": True},
    )
    p, _, engines = simulated_pipeline(cfg, replicas=2, update_time=0.7, text=lambda prompt, rng: "\\boxed{1}")
    served_at_validation: list[tuple[int, list[int]]] = []
    validate = p.validator.run

    async def recording_run(version: int) -> dict[str, float]:
        served_at_validation.append((version, [e.version for e in engines]))
        return await validate(version)

    p.validator.run = recording_run
    run_virtual(run(p))
    assert [v for v, _ in served_at_validation] == [0, 2, 4, 5]
    for version, served in served_at_validation:
        assert served == [version, version], f"validation of version {version} ran on versions {served}"
    assert all(r.healthy for r in p.engines.replicas)  # no replica lost to a refused duplicate update


def test_a_blocking_transfer_and_the_background_updater_never_push_one_replica_twice() -> None:
    async def scenario() -> None:
        sync, trainer, engines, gate, tracker, errors, _ = controller("fully-async", update_time=1.0)
        trainer.version = 1
        await sync.after_step(TrainResult(1, 1, 0))  # background updates start
        await asyncio.sleep(0.1)
        await sync._transfer(1, pause_mode="wait")  # e.g. a replica that recovered, moved while they run
        await sync.settle(1)
        assert [r.version for r in engines.replicas] == [1, 1]
        assert all(r.healthy for r in engines.replicas) and not errors.records
        assert sync.transfers == 2 and trainer.exports == 1  # the published export was reused
        await sync.close()

    run_virtual(scenario())
