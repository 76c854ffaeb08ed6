"""Staleness accounting: the gate, and properties of whole simulated runs.

Runs use simulated engines on a virtual clock (services/controller/testing/simulated/):
minutes of pipeline time take milliseconds, and a deadlock raises.
"""

from __future__ import annotations

import asyncio
import re

from hypothesis import HealthCheck, given, settings

from services.controller.loop import run
from services.controller.testing.simulated import run_virtual
from services.controller.batches.staleness import StalenessGate, is_stale
from tests.unit.controller.controller_helpers import STALENESS_RUN, config, items, simulated_pipeline, staleness_run


async def test_the_gate_counts_samples_in_flight_against_the_bound() -> None:
    gate = StalenessGate(batch_size=4, limit=1)
    # Rollouts on version 0 may fill batches 0 and 1 (trained at versions 0 and 1).
    for _ in range(4):
        assert await asyncio.wait_for(gate.admit(2), 1)
    assert gate.pending == 8 and not gate.fits(1)
    blocked = asyncio.ensure_future(gate.admit(2))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    gate.accept(4)  # batch 0 assembled: nothing frees, batch 2 would still be 2 versions stale
    await asyncio.sleep(0.01)
    assert not blocked.done()
    gate.set_rollout_version(1)  # rollouts moved to version 1: batch 2 is within 1
    assert await asyncio.wait_for(blocked, 1)


async def test_dropped_samples_free_their_positions() -> None:
    gate = StalenessGate(batch_size=2, limit=0)
    assert await gate.admit(2)
    blocked = asyncio.ensure_future(gate.admit(2))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    gate.drop(2)  # e.g. a group with equal rewards
    assert await asyncio.wait_for(blocked, 1)
    assert gate.next_batch_version == 0


async def test_unbounded_gate_and_closing() -> None:
    gate = StalenessGate(batch_size=1, limit=None)
    for _ in range(100):
        assert await gate.admit(1)
    bounded = StalenessGate(batch_size=1, limit=0)
    assert await bounded.admit(1)
    waiter = asyncio.ensure_future(bounded.admit(1))
    await asyncio.sleep(0.01)
    bounded.close()
    assert await asyncio.wait_for(waiter, 1) is False


def test_is_stale() -> None:
    assert not is_stale(3, 4, 1) and is_stale(2, 4, 1) and not is_stale(0, 100, None)


def test_a_failed_batch_shifts_later_batches_one_version_back() -> None:
    gate = StalenessGate(batch_size=2, limit=1, base_version=5)
    gate.pending = 4
    gate.accept(4)
    assert gate.next_batch_version == 7
    gate.batch_not_trained()
    assert gate.next_batch_version == 6


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STALENESS_RUN)
def test_batch_async_never_trains_a_sample_over_the_threshold(**kw) -> None:
    p, trainer = staleness_run("batch-async", **kw)
    for version, sample_versions in trainer.trained:
        assert all(0 <= version - v <= kw["threshold"] for v in sample_versions), (version, sample_versions)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**{k: v for k, v in STALENESS_RUN.items() if k != "threshold"})
def test_sync_mode_trains_only_on_policy_samples(**kw) -> None:
    p, trainer = staleness_run("sync", threshold=0, **kw)
    for record in p.train_worker.history:
        assert set(record.sample_versions) == {record.trainer_version}
        assert set(record.sample_end_versions) == {record.trainer_version}  # no weight change mid-generation
    assert p.processor.dropped["stale"] == 0  # nothing was generated ahead of the weights


def test_fully_async_never_blocks_on_staleness_but_bounds_each_trained_token_and_correct_keeps_stale_samples() -> None:
    p, trainer = staleness_run("fully-async", 0, 2, 2, 12, 1.5, 0.05, "keep", 1, 0.0, seed=3, steps=10)
    assert max(v - s for v, vs in trainer.trained for s in vs) >= 2  # ran ahead
    bound = p.config.staleness.fully_async_bound
    assert all(v - token <= bound for v, tokens in trainer.trained_tokens for token in tokens)

    cfg = config(mode="batch-async", staleness={"threshold": 1, "policy": "correct"}, run={"max_steps": 10},
                 worker={"max_in_flight": 8}, data={"train": {"items": items(400)}})
    assert cfg.loss.is_cap == 2.0
    p, trainer, _ = simulated_pipeline(cfg, seed=1, gen_sigma=1.5)
    run_virtual(run(p))
    assert p.processor.dropped["stale"] == 0


def _index(prompt) -> int:
    return int(re.search(r"question (\d+)", str(prompt.messages)).group(1))


def test_dapo_refills_the_batch_with_effective_groups_only() -> None:
    captured = []

    def text(prompt, rng):
        i = _index(prompt)
        # Every third task is always answered right: its group has equal rewards.
        return f"\\boxed{{{i % 4 if i % 3 == 0 else rng.randint(0, 3)}}}"

    cfg = config(algorithm={"name": "dapo", "train_batch_size": 16}, run={"max_steps": 6}, data={"train": {"items": items(400)}})
    p, trainer, _ = simulated_pipeline(cfg, seed=2, text=text)
    original = trainer.train_step

    async def capture(batch, loss, **kw):
        captured.append(batch)
        return await original(batch, loss, **kw)

    trainer.train_step = capture
    run_virtual(run(p))
    assert len(captured) == 6 and all(b.size == 16 for b in captured)  # every batch full
    for batch in captured:
        groups: dict[str, list[float]] = {}
        for t in batch.trajectories:
            groups.setdefault(t.task.id, []).append(t.reward)
        assert all(max(r) > min(r) for r in groups.values())  # only effective groups
        assert all(int(tid.split(":")[2]) % 3 != 0 for tid in groups)
    assert p.processor.dropped["equal_rewards"] >= 6
