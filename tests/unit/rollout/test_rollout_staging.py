"""A rollout stages each MEMORY update into the tensors of the previous one,
only once the engine has copied them out, and never lets a reused set leak
old or broken bytes into the served weights."""

from __future__ import annotations

import pytest
import torch

from flywheel.errors import DataLoss
from services.rollout.config import RolloutConfig
from services.rollout.serving.core import RolloutCore
from services.rollout.engine.base import NO_FAULTS, StagedWeights, TensorSpec
from services.rollout.weights.sources import memory_stage
from services.rollout.weights.staging import StagingBuffers
from services.rollout.weights.transaction import WeightUpdates
from tests.unit.rollout.fake_engine import FakeEngine, identity_of
from tests.unit.rollout.fake_synchronizer import FakeSynchronizer

SPECS = {"w": TensorSpec(torch.float32, (4,))}


def make_core(reuse: bool = True) -> tuple[WeightUpdates, FakeEngine]:
    config = RolloutConfig.model_validate({"updates": {"reuse_staging": reuse}})
    engine = FakeEngine()
    core = RolloutCore(config, engine=engine, codec=object(), model_name="fake")  # type: ignore[arg-type]
    return WeightUpdates(core, config), engine


def staged(version: int, tensors: dict[str, torch.Tensor], **kwargs: object) -> StagedWeights:
    return StagedWeights(version, tensors, nbytes=16, identity=identity_of(tensors), **kwargs)  # type: ignore[arg-type]


def test_a_set_is_handed_out_once_and_only_if_it_fits() -> None:
    buffers = StagingBuffers()
    assert buffers.take(SPECS) is None and buffers.held_bytes == 0
    mine = {"w": torch.zeros(4)}
    buffers.give_back(mine)
    assert buffers.held_bytes == 16
    assert buffers.take(SPECS) is mine
    assert buffers.take(SPECS) is None  # the caller owns it now
    for other in ({"w": torch.zeros(5)}, {"w": torch.zeros(4, dtype=torch.float64)}, {"v": torch.zeros(4)}):
        buffers.give_back(other)
        assert buffers.take(SPECS) is None
        assert buffers.held_bytes == 0  # a set of another model is dropped, not kept
    off = StagingBuffers(enabled=False)
    off.give_back(mine)
    assert off.take(SPECS) is None and off.held_bytes == 0


async def test_staged_tensors_are_released_only_after_the_swap_copied_them() -> None:
    updates, engine = make_core()
    events: list[str] = []
    swap = engine.swap_weights

    async def recording_swap(staged: StagedWeights, faults=NO_FAULTS) -> None:
        events.append("swap")
        await swap(staged, faults)

    engine.swap_weights = recording_swap  # type: ignore[method-assign]

    async def stage() -> StagedWeights:
        return staged(1, {"w": torch.full((4,), 2.0)}, release=lambda: events.append("release"))

    await updates.run(1, stage, "wait", 10)
    assert events == ["swap", "release"]


async def test_a_copy_made_by_prepare_frees_the_staged_tensors_before_the_pause() -> None:
    updates, engine = make_core()
    events: list[str] = []

    async def prepare(staged: StagedWeights, faults=NO_FAULTS) -> StagedWeights:
        events.append("prepare")
        return StagedWeights(staged.version, {"w": staged.tensors["w"].clone()}, nbytes=staged.nbytes,
                             identity=staged.identity)

    swap = engine.swap_weights

    async def recording_swap(staged: StagedWeights, faults=NO_FAULTS) -> None:
        events.append("swap")
        await swap(staged, faults)

    engine.prepare_weights = prepare  # type: ignore[method-assign]
    engine.swap_weights = recording_swap  # type: ignore[method-assign]

    async def stage() -> StagedWeights:
        return staged(1, {"w": torch.ones(4)}, release=lambda: events.append("release"))

    await updates.run(1, stage, "wait", 10)
    assert events == ["prepare", "release", "swap"]
    assert torch.equal(engine.weights["w"], torch.ones(4))


async def test_a_failed_swap_still_releases() -> None:
    updates, engine = make_core()
    released: list[int] = []

    async def broken_swap(staged: StagedWeights, faults=NO_FAULTS) -> None:
        raise RuntimeError("engine fell over")

    engine.swap_weights = broken_swap  # type: ignore[method-assign]

    async def stage() -> StagedWeights:
        return staged(1, {"w": torch.ones(4)}, release=lambda: released.append(1))

    with pytest.raises(RuntimeError):
        await updates.run(1, stage, "wait", 10)
    assert released == [1]


@pytest.mark.parametrize("reuse", [True, False])
async def test_memory_updates_reuse_one_set_and_serve_each_version_exactly(reuse: bool) -> None:
    updates, engine = make_core(reuse)
    sync = FakeSynchronizer()
    values = {1: 1.5, 2: -3.0, 3: 7.0, 4: 0.25}
    for version, value in values.items():
        sync.add(version, {"w": torch.full((4,), value)})
    sync.corrupt[3] = 0
    await sync.start()
    staged_in: list[torch.Tensor] = []  # kept alive, so a fresh set cannot land at a freed one's address

    def stage_of(version: int):
        inner = memory_stage(sync.address, version, SPECS, token=None, timeout=10, max_message_bytes=8 << 20,
                             buffers=updates.staging)

        async def stage() -> StagedWeights:
            staged = await inner()
            staged_in.append(staged.tensors["w"])
            return staged

        return stage

    try:
        for version in (1, 2):
            await updates.run(version, stage_of(version), "wait", 10)
            assert torch.equal(engine.weights["w"], torch.full((4,), values[version]))
        assert updates.staging.held_bytes == (16 if reuse else 0)
        with pytest.raises(DataLoss):  # a corrupt chunk: the held set is dropped, v2 keeps serving
            await updates.run(3, stage_of(3), "wait", 10)
        assert engine.version == 2 and torch.equal(engine.weights["w"], torch.full((4,), values[2]))
        assert updates.staging.held_bytes == 0
        await updates.run(4, stage_of(4), "wait", 10)
        assert torch.equal(engine.weights["w"], torch.full((4,), values[4]))
    finally:
        await sync.stop()
    same = staged_in[0].untyped_storage().data_ptr() == staged_in[1].untyped_storage().data_ptr()
    assert same is reuse  # update 2 was staged into update 1's tensors
    assert engine.swaps == [1, 2, 4]
