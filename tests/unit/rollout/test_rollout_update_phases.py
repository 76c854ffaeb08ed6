"""A weight update as a transaction in phases: transfer, admit, apply, verify,
reopen, each timed. VERIFIED only with every tensor measured (RESIDENT, or
RECEIVED with a passing probe) and equal to the version's; anything else
quarantines the replica before generation's gate can reopen, until an update
verifies (services.rollout.weights.transaction)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from flywheel.codec.identity import VersionIdentity, identify
from flywheel.errors import Aborted, DataLoss, FailedPrecondition, Unavailable
from flywheel.probe import ProbeBatch
from flywheel.synchronizer.client_types import VersionProof
from flywheel.synchronizer.types import UpdatePhase
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import SamplingSpec, StagedWeights
from services.rollout.serving.core import RolloutCore
from services.rollout.weights.transaction import UpdateFailed, UpdateReport, UpdateUnverified, WeightUpdates
from tests.unit.rollout.fake_engine import FakeEngine
from tests.unit.rollout.test_rollout_core import prompt


def make(tmp_path: Path, apply_timeout: float = 5.0, engine: FakeEngine | None = None,
         **updates: object) -> tuple[WeightUpdates, FakeEngine, Path, list[UpdateReport]]:
    faults = tmp_path / "faults.json"
    config = RolloutConfig.model_validate(
        {"updates": {"faults_file": str(faults), "apply_timeout_seconds": apply_timeout, **updates}})
    engine = engine or FakeEngine(0.001)
    core = RolloutCore(config, engine=engine, codec=object(), model_name="fake")  # type: ignore[arg-type]
    weights = WeightUpdates(core, config)
    reports: list[UpdateReport] = []
    weights.observers.append(reports.append)
    return weights, engine, faults, reports


def version(n: int, value: float, names: tuple[str, ...] = ("w",), probe_of: FakeEngine | None = None,
            release: list | None = None):
    """A stage of version `n` (every tensor `value`, with its identity); with `probe_of`, the version
    carries the probe that engine's model scores on these weights (what the trainer would publish)."""
    tensors = {name: torch.full((4,), value) for name in names}
    identity = identify(tensors)
    probe = None
    if probe_of is not None:
        ids = ((1, 2, 3, 4), (5, 6, 7))
        saved = probe_of.weights
        probe_of.weights = tensors
        probe = ProbeBatch.of(ids, [probe_of.fake_logprobs(s) for s in ids])
        probe_of.weights = saved

    async def stage() -> StagedWeights:
        staged = StagedWeights(version=n, tensors={k: t.clone() for k, t in tensors.items()}, nbytes=16 * len(names),
                               identity=identity, probe=probe)
        if release is not None:
            staged.release = lambda: release.append(time.monotonic())
        return staged

    return stage, identity


async def test_every_phase_is_timed_and_the_resident_identity_is_the_versions(tmp_path: Path) -> None:
    updates, engine, _, reports = make(tmp_path)
    stage, identity = version(1, 1.5)
    outcome = await updates.run(1, stage, "wait", 10)
    t = outcome.timings
    assert outcome.identity == identity.digest == updates.identity
    assert t.transfer_seconds >= 0 and t.apply_seconds > 0 and t.verify_seconds > 0 and t.pause_seconds > 0
    # The pause covers admit, apply, verify and reopen, and nothing of the transfer.
    assert t.pause_seconds >= t.admit_seconds + t.apply_seconds + t.verify_seconds
    assert reports[-1].error is None and reports[-1].resident_identity == identity.digest
    c = reports[-1].coverage
    assert (c.tensors, c.resident_tensors, c.received_tensors, c.complete) == (1, 1, 0, True)
    assert c.methods == ["resident"]


async def test_a_tensor_loaded_wrong_is_caught_and_quarantines_until_an_update_verifies(tmp_path: Path) -> None:
    updates, engine, faults, reports = make(tmp_path)
    core = updates.core
    faults.write_text(json.dumps({"corrupt_readable": True}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed, match="1 tensor\\(s\\) differ: w") as info:
        await updates.run(1, stage, "wait", 10)
    assert info.value.code == "DATA_LOSS" and info.value.phase == UpdatePhase.VERIFY
    assert reports[-1].failed_phase == UpdatePhase.VERIFY and not reports[-1].unverified
    assert core.status().quarantine_reason and engine.version == 1
    with pytest.raises(Unavailable, match="quarantined"):
        await core.generate([prompt("a")], SamplingSpec(max_tokens=2))

    # The same version again, while the fault holds: still refused.
    with pytest.raises(UpdateFailed):
        await updates.run(1, stage, "wait", 10)
    faults.unlink()  # the fault is cleared
    outcome = await updates.run(1, stage, "wait", 10)  # the same number: it is not trusted yet
    assert outcome.version == 1 and not core.status().quarantine_reason
    (out,) = await core.generate([prompt("b")], SamplingSpec(max_tokens=2))
    assert out.samples[0].version_start == 1
    with pytest.raises(FailedPrecondition, match="not newer"):
        await updates.run(1, stage, "wait", 10)  # once it verified, versions only go up again


async def test_a_generation_that_waited_for_its_weights_while_an_update_failed_is_refused(tmp_path: Path) -> None:
    # A generation checks the quarantine, then waits (NeedSync, the version it needs); the update fails
    # meanwhile and leaves the engine stamped with its number on weights that are no version. The request
    # must be refused once it is past that wait, not run on them (CI saw samples of a failed version trained).
    updates, engine, faults, _ = make(tmp_path)
    core = updates.core
    waiting, go = asyncio.Event(), asyncio.Event()

    async def weights_gate(run_step: int, min_version: int) -> None:
        waiting.set()
        await go.wait()

    core.weights_gate = weights_gate
    request = asyncio.ensure_future(core.generate([prompt("a")], SamplingSpec(max_tokens=2), run_step=2, min_version=1))
    await waiting.wait()
    faults.write_text(json.dumps({"corrupt_readable": True}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed):
        await updates.run(1, stage, "wait", 10)
    assert engine.version == 1 and core.status().quarantine_reason
    go.set()
    with pytest.raises(Unavailable, match="quarantined"):
        await request


async def test_an_apply_past_its_deadline_quarantines_and_the_next_update_waits_for_it(tmp_path: Path) -> None:
    # The hung apply outlives its 1 s deadline by 0.2 s, so the next update's wait for it (also up to
    # 1 s) has 0.8 s of margin for a loaded machine.
    updates, engine, faults, reports = make(tmp_path, apply_timeout=1.0)
    faults.write_text(json.dumps({"apply_delay_seconds": 1.2}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed, match="apply did not finish within 1 s") as info:
        await updates.run(1, stage, "wait", 10)
    assert info.value.phase == UpdatePhase.APPLY and reports[-1].failed_phase == UpdatePhase.APPLY
    assert updates.core.status().quarantine_reason and not updates.core.status().updating  # the gate is open again
    faults.unlink()
    stage2, identity2 = version(2, 2.5)
    outcome = await updates.run(2, stage2, "wait", 10)  # waits out the hung apply, then loads
    assert outcome.identity == identity2.digest and engine.swaps == [1, 2]
    assert not updates.core.status().quarantine_reason


async def test_a_late_apply_keeps_its_staged_tensors_until_it_has_ended(tmp_path: Path) -> None:
    updates, engine, faults, _ = make(tmp_path, apply_timeout=0.3)
    faults.write_text(json.dumps({"apply_delay_seconds": 0.8}))
    released: list[float] = []
    stage, _ = version(1, 1.5, release=released)
    started = time.monotonic()
    with pytest.raises(UpdateFailed, match="apply did not finish"):
        await updates.run(1, stage, "wait", 10)
    # The update failed at its deadline; the late apply still reads the staged tensors.
    assert released == [] and engine.swaps == []
    while not released:
        await asyncio.sleep(0.02)
        assert time.monotonic() - started < 5, "the staged tensors were never released"
    assert engine.swaps == [1]  # the apply ended first
    assert released[0] - started >= 0.75


async def test_an_engine_that_reads_back_part_of_the_weights_is_not_verified_by_echo(tmp_path: Path) -> None:
    """vLLM on CPU reads back embeddings and norms only. Here the engine reads back "w" and one element
    of the tensor it cannot read ("v") is wrong after the load: no probe, so nothing proves "v" (its
    RECEIVED digest is right: the bytes came in whole, the load spoilt them). UNVERIFIED, quarantined."""
    engine = FakeEngine(0.001, tensors=("w", "v"), readable=("w",))
    updates, engine, faults, reports = make(tmp_path, engine=engine)
    faults.write_text(json.dumps({"scale_linear": 1.01}))
    stage, identity = version(1, 1.5, names=("w", "v"))
    with pytest.raises(UpdateUnverified, match="not proven") as info:
        await updates.run(1, stage, "wait", 10)
    assert info.value.phase == UpdatePhase.VERIFY and reports[-1].unverified
    c = reports[-1].coverage
    assert (c.tensors, c.resident_tensors, c.received_tensors, c.probe.ran, c.complete) == (2, 1, 1, False, False)
    assert updates.core.status().quarantine_reason and updates.identity == b""


async def test_the_probe_catches_what_reading_back_cannot(tmp_path: Path) -> None:
    engine = FakeEngine(0.001, tensors=("w", "v"), readable=("w",))
    engine.supports_prompt_logprobs = True  # type: ignore[misc]
    updates, engine, faults, reports = make(tmp_path, engine=engine, probe_tolerance=1e-6)
    faults.write_text(json.dumps({"scale_linear": 1.01}))
    stage, _ = version(1, 1.5, names=("w", "v"), probe_of=engine)
    with pytest.raises(UpdateFailed, match="probe of 5 tokens.*FAILED") as info:
        await updates.run(1, stage, "wait", 10)
    assert not isinstance(info.value, UpdateUnverified)
    assert reports[-1].coverage.probe.ran and not reports[-1].coverage.probe.passed
    assert updates.core.status().quarantine_reason

    faults.unlink()
    outcome = await updates.run(1, stage, "wait", 10)
    c = outcome.coverage
    assert (c.resident_tensors, c.received_tensors, c.probe.passed, c.complete) == (1, 1, True, True)
    assert c.methods == ["resident", "received", "probe"] and not updates.core.status().quarantine_reason


@pytest.mark.parametrize("fault", ["raise_halfway", "admit"])
async def test_the_gate_never_reopens_on_an_exception(tmp_path: Path, fault: str) -> None:
    """An apply that raises anything (not only a verification failure), or an admit that fails, leaves
    the engine holding weights that are no version: a request waiting at the gate is refused there."""
    updates, engine, faults, reports = make(tmp_path)
    core = updates.core
    faults.write_text(json.dumps({"apply_delay_seconds": 0.3, **({"raise_halfway": True} if fault != "admit" else {})}))
    if fault == "admit":
        real_pause = engine.pause

        async def pause(mode):
            if mode != "abort":
                await asyncio.sleep(0.3)
                raise RuntimeError("the engine failed to pause")
            await real_pause(mode)

        engine.pause = pause  # type: ignore[method-assign]
    stage, _ = version(1, 1.5)
    update = asyncio.ensure_future(updates.run(1, stage, "wait", 10))
    while not core.status().updating:
        await asyncio.sleep(0.005)
    waiting = asyncio.ensure_future(core.generate([prompt("late")], SamplingSpec(max_tokens=2)))
    while not core._at_gate:
        await asyncio.sleep(0.005)
    with pytest.raises(RuntimeError):
        await update
    with pytest.raises(Unavailable, match="quarantined"):
        await waiting
    assert not engine.running and reports[-1].error is not None and core.status().quarantine_reason


async def test_requests_frozen_by_keep_do_not_go_on_with_weights_that_failed_verification(tmp_path: Path) -> None:
    updates, engine, faults, _ = make(tmp_path)
    engine.step_seconds = 0.01
    running = asyncio.ensure_future(updates.core.generate([prompt("long")], SamplingSpec(max_tokens=100)))
    while not engine.running:
        await asyncio.sleep(0.005)
    faults.write_text(json.dumps({"corrupt_readable": True}))
    stage, _ = version(1, 1.5)
    with pytest.raises(UpdateFailed):
        await updates.run(1, stage, "keep", 10)
    (out,) = await running
    assert out.samples[0].finish_reason == "abort" and len(out.samples[0].token_ids) < 100


async def test_the_synchronizers_record_is_what_the_update_is_verified_against(tmp_path: Path) -> None:
    updates, engine, _, reports = make(tmp_path)
    stage, identity = version(1, 1.5)
    other = identify({"w": torch.full((4,), 7.0)})

    async def recorded() -> VersionProof:
        return VersionProof(1, other, None)

    # Staged bytes that are not the recorded version: refused before anything loads (old weights serve).
    with pytest.raises(DataLoss, match="not the version the synchronizer recorded"):
        await updates.run(1, stage, "wait", 10, proof=recorded)
    assert engine.swaps == [] and not updates.core.status().quarantine_reason
    assert reports[-1].failed_phase == UpdatePhase.TRANSFER

    async def forged() -> VersionProof:  # per-tensor digests that do not make the identity
        return VersionProof(1, VersionIdentity(identity.digest, dict(other.tensors)), None)

    with pytest.raises(DataLoss, match="do not make its identity"):
        await updates.run(1, stage, "wait", 10, proof=forged)

    async def right() -> VersionProof:
        return VersionProof(1, identity, None)

    outcome = await updates.run(1, stage, "wait", 10, proof=right)
    assert outcome.identity == identity.digest and outcome.coverage.complete


@pytest.mark.parametrize("faulty", [False, True])
async def test_what_frozen_requests_make_during_the_probe_waits_for_the_verdict(tmp_path: Path, faulty: bool) -> None:
    """keep: the probe runs the engine, so requests frozen in place go on meanwhile, on weights not yet
    proven. Their output is held until the verdict; if the weights fail, they end aborted."""
    engine = FakeEngine(0.01, tensors=("w", "v"), readable=("w",))
    engine.supports_prompt_logprobs = True  # type: ignore[misc]
    score = engine.score

    async def slow_score(sequences):
        await asyncio.sleep(0.1)  # some steps of the frozen request run meanwhile
        return await score(sequences)

    engine.score = slow_score  # type: ignore[method-assign]
    updates, engine, faults, _ = make(tmp_path, engine=engine, probe_tolerance=1e-6)
    streamed: list[int] = []

    async def stream() -> str:
        async for deltas in updates.core.generate_stream(prompt("long"), SamplingSpec(max_tokens=40)):
            for d in deltas:
                streamed.extend(d.token_ids)
                if d.final is not None:
                    return d.final.finish_reason
        return "none"

    running = asyncio.ensure_future(stream())
    while not engine.running:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    if faulty:
        faults.write_text(json.dumps({"scale_linear": 1.01}))
    stage, _ = version(1, 1.5, names=("w", "v"), probe_of=engine)
    if faulty:
        with pytest.raises(UpdateFailed, match="probe"):
            await updates.run(1, stage, "keep", 10)
        assert await running == "abort"
        assert 101 not in streamed, "tokens of the failed weights reached the caller"
    else:
        await updates.run(1, stage, "keep", 10)
        assert await running == "length"
        assert streamed[0] == 100 and streamed[-1] == 101 and len(streamed) == 40


async def test_generation_goes_on_during_the_probe_and_nothing_it_makes_goes_out_before_the_verdict(
    tmp_path: Path,
) -> None:
    """The probe runs after generation reopens (the engine is not idle through a forward pass), and a
    request admitted meanwhile is held until the verdict: delivered once the version is proven, or
    ended aborted, nothing delivered, when the probe fails."""
    engine = FakeEngine(0.005, tensors=("w", "v"), readable=("w",))
    engine.supports_prompt_logprobs = True  # type: ignore[misc]
    score = engine.score
    probing = asyncio.Event()

    async def slow_score(sequences):
        probing.set()
        await asyncio.sleep(0.2)
        return await score(sequences)

    engine.score = slow_score  # type: ignore[method-assign]
    updates, engine, faults, _ = make(tmp_path, engine=engine, probe_tolerance=1e-6)
    for n, faulty in ((1, False), (2, True)):
        probing.clear()
        if faulty:
            faults.write_text(json.dumps({"scale_linear": 1.01}))
        stage, _ = version(n, 1.5 + n, names=("w", "v"), probe_of=engine)
        update = asyncio.ensure_future(updates.run(n, stage, "wait", 10, rewind=True))
        await probing.wait()
        started = time.monotonic()
        request = asyncio.ensure_future(updates.core.generate([prompt(f"during-{n}")], SamplingSpec(max_tokens=4)))
        await asyncio.sleep(0.1)
        assert not request.done() and engine.running, "generation must go on during the probe, its result held"
        if faulty:
            with pytest.raises(UpdateFailed, match="probe"):
                await update
            (out,) = await request
            assert out.samples[0].finish_reason == "abort"
        else:
            await update
            (out,) = await request
            assert out.samples[0].finish_reason == "length" and out.samples[0].token_ids == [101] * 4
            assert time.monotonic() - started >= 0.1  # delivered only after the verdict


@pytest.mark.parametrize("call", ["generate", "score"])
async def test_what_was_made_during_a_failed_probe_is_withheld_even_if_it_comes_out_after_the_verdict(
    tmp_path: Path, call: str,
) -> None:
    """A request whose tokens (or scores) were made on the unproven weights but that comes out only
    after the verdict, before the abort reaches it (the control lock was busy: an operator, the next
    update), ends aborted all the same: what counts is when its work was made, not delivered."""
    engine = FakeEngine(0.005, tensors=("w", "v"), readable=("w",))
    engine.supports_prompt_logprobs = True  # type: ignore[misc]
    score = engine.score
    started = asyncio.Event()
    updates, engine, faults, _ = make(tmp_path, engine=engine, probe_tolerance=1e-6)
    core = updates.core

    async def slow_score(sequences):
        if len(sequences) == 2:  # the probe (its two sequences)
            started.set()
            await asyncio.sleep(0.05)
            await core.control.acquire()  # busy as the verdict comes: the abort waits
            asyncio.get_running_loop().call_later(0.5, core.control.release)
        return await score(sequences)

    score_tokens = engine.score_tokens

    async def slow_score_tokens(sequences, top_logprobs=0):
        await asyncio.sleep(0.15)  # the caller's scoring ends past the verdict
        return await score_tokens(sequences, top_logprobs)

    engine.score = slow_score  # type: ignore[method-assign]
    engine.score_tokens = slow_score_tokens  # type: ignore[method-assign]
    faults.write_text(json.dumps({"scale_linear": 1.01}))
    stage, _ = version(1, 2.5, names=("w", "v"), probe_of=engine)
    update = asyncio.ensure_future(updates.run(1, stage, "wait", 10))
    await started.wait()
    if call == "generate":  # 30 tokens: it runs on past the probe's verdict and ends within the busy half second
        request = asyncio.ensure_future(core.generate([prompt("during")], SamplingSpec(max_tokens=30)))
    else:
        request = asyncio.ensure_future(core.score([[1, 2, 3]]))
    with pytest.raises(UpdateFailed, match="probe"):
        await update
    if call == "generate":
        (out,) = await request
        assert out.samples[0].finish_reason == "abort" and out.samples[0].token_ids == [], out.samples[0]
    else:
        with pytest.raises(Aborted, match="failed verification"):
            await request
