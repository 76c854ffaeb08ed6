"""The core's admission, update gate, pause modes and versions, on a fake engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flywheel.errors import DataLoss, DeadlineExceeded, FailedPrecondition
from services.rollout.config import RolloutConfig
from services.rollout.serving.core import QueueFull, RolloutCore
from services.rollout.engine.base import SamplingSpec, StagedWeights
from services.rollout.serving.prompts import ResolvedPrompt
from services.rollout.weights.transaction import WeightUpdates
from tests.unit.rollout.fake_engine import FakeEngine, identity_of


def make_core(max_pending: int = 512, step_seconds: float = 0.001) -> tuple[RolloutCore, FakeEngine]:
    config = RolloutConfig.model_validate({"limits": {"max_pending_requests": max_pending, "retry_after_seconds": 2}})
    engine = FakeEngine(step_seconds)
    core = RolloutCore(config, engine=engine, codec=object(), model_name="fake")  # type: ignore[arg-type]
    return core, engine


def prompt(rid: str = "") -> ResolvedPrompt:
    return ResolvedPrompt(ids=[1, 2, 3], request_id=rid)


def staged(version: int, value: float) -> StagedWeights:
    tensors = {"w": torch.full((4,), value)}
    return StagedWeights(version=version, tensors=tensors, nbytes=16, identity=identity_of(tensors))


async def test_generate_tags_samples_with_the_serving_version() -> None:
    core, _ = make_core()
    (out,) = await core.generate([prompt("a")], SamplingSpec(max_tokens=3))
    assert out.request_id == "a" and out.prompt_ids == [1, 2, 3]
    (sample,) = out.samples
    assert sample.token_ids == [100, 100, 100]
    assert (sample.version_start, sample.version_end) == (0, 0)


async def test_queue_full_is_refused_with_a_retry_hint_and_frees_on_finish() -> None:
    core, _ = make_core(max_pending=4, step_seconds=0.01)
    running = asyncio.create_task(core.generate([prompt(), prompt()], SamplingSpec(n=2, temperature=1, max_tokens=5)))
    await asyncio.sleep(0.005)
    with pytest.raises(QueueFull) as info:
        await core.generate([prompt()], SamplingSpec(max_tokens=1))
    assert info.value.code == "RESOURCE_EXHAUSTED" and 2 <= info.value.retry_after_seconds <= 4
    assert "4 of 4" in str(info.value)
    await running
    await core.generate([prompt()], SamplingSpec(max_tokens=1))  # capacity is back


async def test_update_bumps_version_and_new_requests_use_new_weights() -> None:
    core, engine = make_core()
    updates = WeightUpdates(core, core.config)

    async def stage() -> StagedWeights:
        return staged(3, 1.5)

    outcome = await updates.run(3, stage, "wait", 10)
    assert outcome.version == 3 and engine.version == 3 and outcome.pause_seconds >= 0
    assert torch.equal(engine.weights["w"], torch.full((4,), 1.5))
    (out,) = await core.generate([prompt()], SamplingSpec(max_tokens=2))
    assert out.samples[0].token_ids == [103, 103]
    assert (out.samples[0].version_start, out.samples[0].version_end) == (3, 3)


async def test_an_update_that_names_no_mode_keeps_requests_going_and_each_token_says_its_version() -> None:
    core, engine = make_core(step_seconds=0.002)
    assert core.config.updates.default_pause_mode == "keep"
    updates = WeightUpdates(core, core.config)
    running = asyncio.create_task(core.generate([prompt("long")], SamplingSpec(max_tokens=60)))
    for version in (1, 2, 3):
        await asyncio.sleep(0.02)

        async def stage(version: int = version) -> StagedWeights:
            return staged(version, float(version))

        outcome = await updates.run(version, stage, None, 10)
        assert outcome.aborted_request_ids == []  # keep aborts nothing
    (out,) = await running
    (sample,) = out.samples
    assert sample.finish_reason == "length" and len(sample.token_ids) == 60
    assert [s.version for s in sample.version_spans] == [0, 1, 2, 3]
    assert [100 + v for s in sample.version_spans for v in [s.version] * (s.end - s.start)] == sample.token_ids
    assert (sample.version_start, sample.version_end) == (0, 3)


async def test_failed_or_late_staging_leaves_weights_and_version() -> None:
    core, engine = make_core()
    updates = WeightUpdates(core, core.config)

    async def corrupt() -> StagedWeights:
        raise DataLoss("chunk 3 does not match its checksum")

    with pytest.raises(DataLoss):
        await updates.run(2, corrupt, "wait", 10)

    async def slow() -> StagedWeights:
        await asyncio.sleep(5)
        return staged(2, 9.0)

    with pytest.raises(DeadlineExceeded, match="still serving 0"):
        await updates.run(2, slow, "wait", 0.05)
    assert engine.version == 0 and engine.swaps == []
    assert torch.equal(engine.weights["w"], torch.zeros(4))
    (out,) = await core.generate([prompt()], SamplingSpec(max_tokens=1))  # the gate is open again
    assert out.samples[0].token_ids == [100]


async def test_version_must_increase() -> None:
    core, _ = make_core()
    updates = WeightUpdates(core, core.config)

    async def stage() -> StagedWeights:
        return staged(1, 1.0)

    await updates.run(1, stage, "wait", 10)
    with pytest.raises(FailedPrecondition, match="not newer"):
        await updates.run(1, stage, "wait", 10)


async def test_requests_during_an_update_wait_and_see_one_version() -> None:
    core, engine = make_core(step_seconds=0.002)
    updates = WeightUpdates(core, core.config)
    release = asyncio.Event()

    async def stage() -> StagedWeights:
        await release.wait()
        return staged(5, 2.0)

    spec = SamplingSpec(max_tokens=4)
    update = asyncio.create_task(updates.run(5, stage, "wait", 10))
    early = [asyncio.create_task(core.generate([prompt()], spec)) for _ in range(10)]
    await asyncio.sleep(0.001)
    release.set()
    late = [asyncio.create_task(core.generate([prompt()], spec)) for _ in range(10)]
    await update
    for task in early + late:
        (out,) = await task
        sample = out.samples[0]
        assert sample.version_start == sample.version_end
        assert sample.token_ids == [100 + sample.version_start] * 4


async def test_pause_abort_reports_aborted_requests_and_holds_new_ones() -> None:
    core, engine = make_core(step_seconds=0.01)
    spec = SamplingSpec(max_tokens=50)
    inflight = [asyncio.create_task(core.generate([prompt(f"r{i}")], spec)) for i in range(3)]
    await asyncio.sleep(0.03)
    aborted, version = await core.pause("abort")
    assert aborted == ["r0", "r1", "r2"] and version == 0
    for task in inflight:
        (out,) = await task
        assert out.samples[0].finish_reason == "abort"
    assert core.status().paused
    held = asyncio.create_task(core.generate([prompt("late")], SamplingSpec(max_tokens=1)))
    await asyncio.sleep(0.03)
    assert not held.done() and core.status().waiting == 1
    assert await core.resume() == 0
    (out,) = await held
    assert out.samples[0].finish_reason == "length"


async def test_update_while_paused_keeps_the_pause() -> None:
    core, engine = make_core()
    updates = WeightUpdates(core, core.config)
    await core.pause("keep")

    async def stage() -> StagedWeights:
        return staged(2, 3.0)

    await updates.run(2, stage, "abort", 10)
    assert core.status().paused and engine.version == 2
    held = asyncio.create_task(core.generate([prompt()], SamplingSpec(max_tokens=1)))
    await asyncio.sleep(0.01)
    assert not held.done()
    await core.resume()
    (out,) = await held
    assert out.samples[0].token_ids == [102]


async def test_without_an_engine_generation_is_a_failed_precondition() -> None:
    core = RolloutCore(RolloutConfig(), engine=None, codec=None, model_name="")
    with pytest.raises(FailedPrecondition, match="no model is loaded"):
        await core.generate([prompt()], SamplingSpec())
    assert core.status().engine == "none"


async def test_an_engine_that_cannot_score_prompts_refuses_to_before_it_runs() -> None:
    from flywheel.errors import InvalidArgument

    core, engine = make_core()
    with pytest.raises(InvalidArgument, match="sampling.prompt_logprobs: this fake engine does not score prompts"):
        await core.generate([prompt()], SamplingSpec(max_tokens=1, prompt_logprobs=True))
    assert not engine.running
