"""Activity tracking, the error reporter's policies and liveness monitoring."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.telemetry.activity import ActivityTracker
from services.controller.rollouts.balancer import EnginePool
from services.controller.telemetry.errors_report import ErrorReporter, RunStopped
from services.controller.rollouts.liveness import LivenessMonitor
from services.controller.loop import run
from services.controller.testing.simulated import SimulatedHealthProbe, SimulatedRolloutEngine, run_virtual
from tests.unit.controller.controller_helpers import config, simulated_pipeline


def test_tokens_quiescence_and_busy_time_on_a_virtual_clock() -> None:
    async def scenario() -> None:
        tracker = ActivityTracker()
        tracker.start_clock()
        a = tracker.begin("rollout", "task-1")
        await asyncio.sleep(1.0)
        b = tracker.begin("rollout", "task-2")
        assert tracker.in_flight("rollout") == 2 and tracker.describe("rollout") == ["rollout:task-1", "rollout:task-2"]
        assert not await tracker.wait_quiescent("rollout", timeout=0.5)
        tracker.end(a)
        tracker.end(a)  # twice is harmless
        waiter = asyncio.ensure_future(tracker.wait_quiescent("rollout"))
        await asyncio.sleep(1.0)
        assert not waiter.done()
        tracker.end(b)
        assert await waiter
        with tracker.track("trainer"):
            await asyncio.sleep(2.0)
        await asyncio.sleep(1.0)
        # rollout busy 1.5 + 1.0 = 2.5 s (overlaps count once); trainer 2 s of 5.5 s.
        assert tracker.busy_seconds("rollout") == pytest.approx(2.5)
        assert tracker.busy_seconds("trainer") == pytest.approx(2.0)
        assert tracker.idle_fraction("trainer") == pytest.approx(1 - 2.0 / 5.5)
        assert tracker.is_quiescent()

    run_virtual(scenario())


@pytest.mark.parametrize(
    ("policy", "stops_at"),
    [("stop_on_error", "error"), ("stop_on_critical", "critical"), ("continue", None)],
)
def test_error_policies(policy: str, stops_at: str | None) -> None:
    errors = ErrorReporter(policy)
    for severity in ("warning", "error", "critical"):
        try:
            raise ValueError(f"a {severity}")
        except ValueError as exc:
            errors.report("rollout_worker", exc, severity=severity, context={"task": "t1"})
        if severity == stops_at:
            assert errors.should_stop and f"rollout_worker {severity}: ValueError: a {severity}" == errors.stop_reason
            with pytest.raises(RunStopped):
                errors.raise_if_stopped()
            break
        assert not errors.should_stop
    record = errors.records[0]
    assert record.module == "rollout_worker" and record.context == {"task": "t1"}
    assert "Traceback" in record.traceback and record.unix_ms > 0


def test_stop_on_error_ends_the_run_at_the_first_failed_task() -> None:
    cfg = config(errors={"policy": "stop_on_error"}, run={"max_steps": 50}, worker={"max_retries": 0})
    p, _, _ = simulated_pipeline(cfg, abort_probability=0.05)
    summary = run_virtual(run(p))
    assert summary.steps < 50 and "rollout_worker error" in summary.stop_reason


async def test_liveness_marks_replicas_and_flags_a_dead_trainer_as_critical() -> None:
    state = {"r1": True, "trainer": True}
    engines = EnginePool([SimulatedRolloutEngine(name="r1"), SimulatedRolloutEngine(name="r2")])
    errors = ErrorReporter("stop_on_critical")
    changes = []
    monitor = LivenessMonitor(
        [SimulatedHealthProbe("r1", lambda: state["r1"]), SimulatedHealthProbe("trainer", lambda: state["trainer"])],
        errors, interval=0.01, critical=["trainer"], max_failures=2,
        on_change=lambda name, ok: (changes.append((name, ok)), engines.mark(name, ok) if name.startswith("r") else None),
    )
    await monitor.check_once()
    state["r1"] = False
    await monitor.check_once()
    assert not engines.replica("r1").healthy and errors.records[-1].severity == "warning"
    state["r1"] = True
    await monitor.check_once()
    assert engines.replica("r1").healthy and changes == [("r1", False), ("r1", True)]
    state["trainer"] = False
    await monitor.check_once()
    assert not errors.should_stop
    await monitor.check_once()
    assert errors.should_stop and "trainer failed 2 health checks" in errors.stop_reason


def test_a_trainer_that_dies_mid_run_stops_it() -> None:
    alive = {"trainer": True}
    cfg = config(run={"max_steps": 100}, services={"health_interval_seconds": 0.1})
    p, trainer, _ = simulated_pipeline(cfg, probes=[SimulatedHealthProbe("trainer", lambda: alive["trainer"])])
    original = trainer.train_step

    async def dies_after_three(batch, loss, **kw):
        if trainer.step >= 3:
            alive["trainer"] = False
            await asyncio.sleep(3600)  # hangs, as a dead service's call would until its deadline
        return await original(batch, loss, **kw)

    trainer.train_step = dies_after_three
    summary = run_virtual(run(p))
    assert summary.steps == 3 and "trainer failed 3 health checks" in summary.stop_reason
