"""Aborted rollouts are retried, not lost; nothing is trained twice; resume
continues where the checkpoint left off."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from services.controller.loop import run
from services.controller.testing.simulated import run_virtual
from tests.unit.controller.controller_helpers import config, items, simulated_pipeline

N_TASKS = 48


@pytest.mark.parametrize(("mode", "pause_mode"), [("sync", "keep"), ("batch-async", "abort"), ("fully-async", "abort")])
def test_every_task_is_trained_exactly_once_despite_aborts(mode: str, pause_mode: str) -> None:
    cfg = config(
        mode=mode,
        staleness={"threshold": 1},
        sync={"pause_mode": pause_mode},
        data={"train": {"items": items(N_TASKS)}, "drop_last": False},
        worker={"max_in_flight": 6, "max_retries": 100},
    )
    # A tenth of the completions come back ABORTed, and weight updates abort in-flight work.
    p, trainer, engines = simulated_pipeline(cfg, seed=4, abort_probability=0.1, gen_sigma=1.0)
    summary = run_virtual(run(p))
    assert summary.stop_reason == "data exhausted"
    trained = Counter(t for record in p.train_worker.history for t in record.task_ids)
    assert set(trained) == {f"train:0:{i}" for i in range(N_TASKS)}  # none lost
    assert set(trained.values()) == {cfg.worker.group_size}  # each group trained once
    assert p.rollouts.stats["re-rollout"] > 0  # aborts did happen and were retried
    assert p.loader.outstanding == 0


def test_a_task_aborted_more_than_max_retries_fails_with_the_error_recorded() -> None:
    cfg = config(worker={"max_retries": 2}, data={"train": {"items": items(8)}, "drop_last": False})
    p, _, engines = simulated_pipeline(cfg, abort_probability=1.0)
    summary = run_virtual(run(p))
    assert summary.steps == 0
    assert p.rollouts.stats["fail"] == 8 and p.rollouts.stats["re-rollout"] == 16
    assert "gave up after 2 retries" in p.errors.records[0].message
    assert p.errors.records[0].context["task"].startswith("train:0:")


def test_resume_from_checkpoint_loses_no_task_and_trains_none_twice(tmp_path: Path) -> None:
    def build(max_steps, trainer=None):
        cfg = config(
            mode="batch-async",
            run={"max_steps": max_steps},
            data={"train": {"items": items(N_TASKS)}, "drop_last": False},
            checkpoint={"interval": 2, "at_end": True},
            resume={"from": "latest"},
            metrics={"jsonl": True},
        )
        # The same trainer service in the second run, with its checkpoints.
        p, t, engines = simulated_pipeline(cfg, seed=9, trainer=trainer)
        p.run_dir = tmp_path
        return p, t

    first, trainer = build(3)
    run_virtual(run(first))
    # Step 3 ended the run; rollouts already in flight or pooled were never trained.
    assert trainer.step == 3 and len(trainer.checkpoints) == 2  # steps 2 and 3 (at the end)
    first_trained = Counter(t for r in first.train_worker.history for t in r.task_ids)

    second, _ = build(None, trainer)
    summary = run_virtual(run(second))
    assert summary.stop_reason == "data exhausted"
    second_trained = Counter(t for r in second.train_worker.history for t in r.task_ids)
    assert not set(first_trained) & set(second_trained)
    assert set(first_trained) | set(second_trained) == {f"train:0:{i}" for i in range(N_TASKS)}
    assert second.train_worker.history[0].step == 4  # continued from the trainer's step


def test_metrics_are_written_as_jsonl_per_step(tmp_path: Path) -> None:
    cfg = config(run={"max_steps": 3}, metrics={"jsonl": True})
    p, _, _ = simulated_pipeline(cfg)
    p.metrics.add(__import__("services.controller.telemetry.metrics_log", fromlist=["JsonlSink"]).JsonlSink(tmp_path / "m.jsonl"))
    run_virtual(run(p))
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for key in ("rollout/reward_mean", "staleness/max", "throughput/samples_per_second", "time/trainer_idle_fraction",
                "pool/trajectory", "time/busy_seconds/rollout", "train/loss"):
        assert key in lines[-1]


def _with_outage(p, down_at: float, up_after: float | None):
    """The run, with its only replica marked down at `down_at` (virtual seconds) and up again
    `up_after` seconds later (never, with None): a replica restarting, or gone."""
    import asyncio

    async def outage() -> None:
        await asyncio.sleep(down_at)
        p.engines.mark("sim-0", False, "restarting")
        if up_after is not None:
            await asyncio.sleep(up_after)
            p.engines.mark("sim-0", True)  # as the liveness monitor does when its check passes again

    async def run_through_outage():
        side = asyncio.ensure_future(outage())
        summary = await run(p)
        side.cancel()
        return summary

    return run_virtual(run_through_outage())


@pytest.mark.parametrize("mode", ["sync", "batch-async", "fully-async"])
def test_while_no_replica_serves_rollouts_wait_instead_of_using_up_their_tasks_retries(mode: str) -> None:
    # One retry only: without the wait, every task tried during the outage would be given up.
    cfg = config(mode=mode, data={"train": {"items": items(N_TASKS)}, "drop_last": False}, worker={"max_retries": 1})
    p, _, _ = simulated_pipeline(cfg, seed=3)
    summary = _with_outage(p, down_at=0.3, up_after=30.0)
    assert summary.stop_reason == "data exhausted"
    assert p.rollouts.stats["fail"] == 0 and not p.errors.records
    trained = Counter(t for record in p.train_worker.history for t in record.task_ids)
    assert set(trained) == {f"train:0:{i}" for i in range(N_TASKS)}


def test_a_replica_that_never_comes_back_stops_the_run_naming_the_setting() -> None:
    cfg = config(data={"train": {"items": items(N_TASKS)}, "drop_last": False},
                 services={"wait_for_rollout_seconds": 5.0})
    p, _, _ = simulated_pipeline(cfg, seed=3)
    summary = _with_outage(p, down_at=0.3, up_after=None)
    assert p.errors.should_stop and "services.wait_for_rollout_seconds" in summary.stop_reason
    assert p.rollouts.stats["fail"] == 0  # stopped, not given up task by task
