"""A weight update as a transaction in phases: transfer, admit, apply, verify,
reopen, each timed; a resident weight that is not the version's (one element
loaded wrong), or an apply past its deadline, quarantines the replica until
an update verifies."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from flywheel.codec.identity import identify
from flywheel.errors import FailedPrecondition, Unavailable
from flywheel.synchronizer.types import UpdatePhase
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import SamplingSpec, StagedWeights
from services.rollout.serving.core import RolloutCore, UpdateFailed, UpdateReport
from tests.unit.rollout.fake_engine import FakeEngine
from tests.unit.rollout.test_rollout_core import prompt


def make_core(tmp_path: Path, apply_timeout: float = 5.0) -> tuple[RolloutCore, FakeEngine, Path, list[UpdateReport]]:
    faults = tmp_path / "faults.json"
    config = RolloutConfig.model_validate(
        {"updates": {"faults_file": str(faults), "apply_timeout_seconds": apply_timeout}})
    engine = FakeEngine(0.001)
    core = RolloutCore(config, engine=engine, codec=object(), model_name="fake")  # type: ignore[arg-type]
    reports: list[UpdateReport] = []
    core.update_observers.append(reports.append)
    return core, engine, faults, reports


def version(n: int, value: float):
    tensors = {"w": torch.full((4,), value)}
    identity = identify(tensors)

    async def stage() -> StagedWeights:
        return StagedWeights(version=n, tensors={"w": tensors["w"].clone()}, nbytes=16, identity=identity)

    return stage, identity


async def test_every_phase_is_timed_and_the_resident_identity_is_the_versions(tmp_path: Path) -> None:
    core, engine, _, reports = make_core(tmp_path)
    stage, identity = version(1, 1.5)
    outcome = await core.update_weights(1, stage, "wait", 10)
    t = outcome.timings
    assert outcome.identity == identity.digest == core.identity
    assert t.transfer_seconds >= 0 and t.apply_seconds > 0 and t.verify_seconds > 0 and t.pause_seconds > 0
    # The pause covers admit, apply, verify and reopen, and nothing of the transfer.
    assert t.pause_seconds >= t.admit_seconds + t.apply_seconds + t.verify_seconds
    assert reports[-1].error is None and reports[-1].resident_identity == identity.digest


async def test_a_tensor_loaded_wrong_is_caught_and_quarantines_until_an_update_verifies(tmp_path: Path) -> None:
    core, engine, faults, reports = make_core(tmp_path)
    faults.write_text(json.dumps({"corrupt_after_apply": True}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed, match="1 tensor\\(s\\) differ: w") as info:
        await core.update_weights(1, stage, "wait", 10)
    assert info.value.code == "DATA_LOSS" and info.value.phase == UpdatePhase.VERIFY
    assert reports[-1].failed_phase == UpdatePhase.VERIFY and reports[-1].resident_identity
    assert core.status().quarantine_reason and engine.version == 1
    with pytest.raises(Unavailable, match="quarantined"):
        await core.generate([prompt("a")], SamplingSpec(max_tokens=2))

    # The same version again, while the fault holds: still refused.
    with pytest.raises(UpdateFailed):
        await core.update_weights(1, stage, "wait", 10)
    faults.unlink()  # the fault is cleared
    outcome = await core.update_weights(1, stage, "wait", 10)  # the same number: it is not trusted yet
    assert outcome.version == 1 and not core.status().quarantine_reason
    (out,) = await core.generate([prompt("b")], SamplingSpec(max_tokens=2))
    assert out.samples[0].version_start == 1
    with pytest.raises(FailedPrecondition, match="not newer"):
        await core.update_weights(1, stage, "wait", 10)  # once it verified, versions only go up again


async def test_an_apply_past_its_deadline_quarantines_and_the_next_update_waits_for_it(tmp_path: Path) -> None:
    # The hung apply outlives its 1 s deadline by 0.2 s, so the next update's wait for it (also up to
    # 1 s) has 0.8 s of margin for a loaded machine.
    core, engine, faults, reports = make_core(tmp_path, apply_timeout=1.0)
    faults.write_text(json.dumps({"apply_delay_seconds": 1.2}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed, match="apply did not finish within 1 s") as info:
        await core.update_weights(1, stage, "wait", 10)
    assert info.value.phase == UpdatePhase.APPLY and reports[-1].failed_phase == UpdatePhase.APPLY
    assert core.status().quarantine_reason and not core.status().updating  # generation's gate is open again
    faults.unlink()
    stage2, identity2 = version(2, 2.5)
    outcome = await core.update_weights(2, stage2, "wait", 10)  # waits out the hung apply, then loads
    assert outcome.identity == identity2.digest and engine.swaps == [1, 2] and not core.status().quarantine_reason


async def test_an_engine_that_cannot_read_its_weights_back_is_verified_as_staged(tmp_path: Path) -> None:
    core, engine, _, reports = make_core(tmp_path)

    async def unreadable(names):
        return None

    engine.resident_digests = unreadable  # type: ignore[method-assign]
    stage, identity = version(1, 1.5)
    outcome = await core.update_weights(1, stage, "wait", 10)
    assert outcome.identity == identity.digest and reports[-1].error is None


async def test_requests_frozen_by_keep_do_not_go_on_with_weights_that_failed_verification(tmp_path: Path) -> None:
    core, engine, faults, _ = make_core(tmp_path)
    engine.step_seconds = 0.01
    running = asyncio.ensure_future(core.generate([prompt("long")], SamplingSpec(max_tokens=100)))
    while not engine.running:
        await asyncio.sleep(0.005)
    faults.write_text(json.dumps({"corrupt_after_apply": True}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed):
        await core.update_weights(1, stage, "keep", 10)
    (out,) = await running
    assert out.samples[0].finish_reason == "abort" and len(out.samples[0].token_ids) < 100


async def test_a_request_waiting_at_the_gate_is_refused_when_the_update_fails_verification(tmp_path: Path) -> None:
    """Requests that arrive during an update wait at the closed gate; if the update fails, the gate
    reopens on weights that are not any version, and they must be refused, not served on them."""
    core, engine, faults, _ = make_core(tmp_path)
    faults.write_text(json.dumps({"corrupt_after_apply": True, "apply_delay_seconds": 0.3}))
    stage, _ = version(1, 1.5)
    update = asyncio.ensure_future(core.update_weights(1, stage, "wait", 10))
    while not core.status().updating:
        await asyncio.sleep(0.005)
    waiting = asyncio.ensure_future(core.generate([prompt("late")], SamplingSpec(max_tokens=2)))
    while not core._at_gate:
        await asyncio.sleep(0.005)
    with pytest.raises(UpdateFailed):
        await update
    with pytest.raises(Unavailable, match="quarantined"):
        await waiting
    assert engine.version == 1 and not engine.running
