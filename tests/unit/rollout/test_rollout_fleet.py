"""A replica in the fleet-update transaction, against a real synchronizer server and the
transformers engine on a tiny model: the policy's pause mode decides what in-flight requests
do while the replica follows a version; every update is reported with its phase timings and
the synchronizer's verdict; a replica that loads a tensor wrong, or that holds a lost
lineage's weights under a current number, is quarantined (no generation) and rejoins only
through an update that verifies."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.codec.identity import identify
from flywheel.errors import Unavailable
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.types import UpdateOutcome, UpdatePhase
from services.rollout.engine.base import SamplingSpec
from services.rollout.engine.transformers_engine import TransformersEngine
from services.rollout.serving.core import RolloutCore
from services.rollout.weights.arrival import WeightArrival
from services.rollout.weights.transaction import WeightUpdates
from services.rollout.serving.prompts import ResolvedPrompt
from services.rollout.weights.link import SynchronizerLink
from services.rollout.weights.sources import checkpoint_stage
from services.synchronizer.embedded import embedded_synchronizer
from tests.unit.rollout.rollout_helpers import rollout_config
from tests.unit.rollout.test_rollout_follower import CID, component, eventually, generate, shifted


@pytest.fixture
def base_state(rollout_model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(rollout_model / "model.safetensors"))


@contextlib.asynccontextmanager
async def replica(model: Path, codec, address: str, **updates: object) -> AsyncIterator[tuple[RolloutCore, SynchronizerLink]]:
    config = rollout_config(model, "transformers", updates=dict(updates), synchronizer={
        "address": address, "component_id": CID, "retry_initial_seconds": 0.05, "retry_max_seconds": 0.3,
        "rpc_timeout_seconds": 2.0})
    engine = TransformersEngine(model, dict(config.engine.args), codec)
    await engine.start()
    core = RolloutCore(config, engine, codec, "tiny")
    link = SynchronizerLink(config, WeightArrival(WeightUpdates(core, config), config, None), grpc_port=50999)
    try:
        yield core, link
    finally:
        await link.stop()
        await engine.stop()


async def long_generation(core: RolloutCore, run_step: int) -> asyncio.Task:
    """A generation that runs for a while (ignores EOS); returns once it is in the engine."""
    prompt = ResolvedPrompt(ids=[1, 2, 3], request_id="long")
    task = asyncio.ensure_future(core.generate(
        [prompt], SamplingSpec(max_tokens=200, ignore_eos=True), run_step=run_step))
    await eventually(lambda: core.status().running > 0, what="the long generation runs")
    return task


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_the_policys_pause_mode_decides_what_in_flight_requests_do(
    rollout_model, codec, base_state, mode: str,
) -> None:
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        await client.configure_policy("fixed", "memory", 1, 0, 30, rollout_wait="none", pause_mode=mode)
        async with replica(rollout_model, codec, sync.address) as (core, link):
            link.start()
            await link.ready(5.0)
            await client.push_weights(shifted(base_state, 0.01), 1)
            running = await long_generation(core, run_step=1)
            await generate(core, run_step=2)  # the replica's step 1 is a sync point: it follows version 1
            await eventually(lambda: core.status().version == 1, what="version 1 installed")
            (out,) = await running
            sample = out.samples[0]
            if mode == "abort":
                assert sample.finish_reason == "abort" and len(sample.token_ids) < 200
            elif mode == "wait":  # it finished on the old weights before the swap
                assert (sample.version_start, sample.version_end, len(sample.token_ids)) == (0, 0, 200)
            else:  # frozen, then continued on the new weights
                assert (sample.version_start, sample.version_end, len(sample.token_ids)) == (0, 1, 200)
            [record] = await eventually(lambda: client.list_updates(1), what="the update reported")
            assert record.outcome == UpdateOutcome.VERIFIED and record.component_id == CID
            assert record.resident_identity == identify(shifted(base_state, 0.01)).digest
            t = record.timings
            assert t.transfer_seconds > 0 and t.apply_seconds > 0 and t.verify_seconds > 0
            # Pause is what generation felt: with keep from the freeze (requests go on arriving while
            # the engine reaches its step boundary), else from the gate closing.
            felt = t.apply_seconds + t.verify_seconds + (0 if mode == "keep" else t.admit_seconds)
            assert t.pause_seconds >= felt
            if mode == "wait":
                assert t.admit_seconds > 0.01, "the swap waited for the long request"


async def test_a_replica_that_loads_a_tensor_wrong_is_quarantined_until_an_update_verifies(
    rollout_model, codec, base_state, tmp_path: Path,
) -> None:
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"corrupt_after_apply": True}))
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        await client.configure_policy("fixed", "memory", 1, 0, 30, rollout_wait="none")
        async with replica(rollout_model, codec, sync.address, faults_file=str(faults)) as (core, link):
            link.start()
            await link.ready(5.0)
            await client.push_weights(shifted(base_state, 0.01), 1)
            await generate(core, run_step=2)  # asks to sync at its step 1
            me = await eventually(lambda: _quarantined(client), what="quarantined by the synchronizer")
            assert "verify of version 1 failed" in me.quarantine_reason
            [failed, *_] = await client.list_updates(1)
            assert failed.outcome == UpdateOutcome.FAILED and failed.failed_phase == UpdatePhase.VERIFY
            with pytest.raises(Unavailable, match="quarantined"):
                await generate(core, run_step=2)

            # Still faulty: a newer version fails too; the replica keeps trying, with backoff.
            await client.push_weights(shifted(base_state, 0.02), 2)
            await eventually(lambda: _failed(client, 2), what="version 2 failed as well")
            assert (await component(client)).quarantined

            faults.unlink()  # the fault is cleared: its next try verifies, and it rejoins
            await eventually(lambda: _not_quarantined(client), what="rejoined")
            assert core.status().version == 2 and not core.status().quarantine_reason
            assert (await generate(core, run_step=3)).version_start == 2
            assert any(r.verified for r in await client.list_updates(2))


async def test_a_replica_holding_a_lost_lineages_weights_under_a_current_number_installs_the_runs(
    rollout_model, codec, base_state, tmp_path: Path,
) -> None:
    old, new = shifted(base_state, 0.05), shifted(base_state, 0.09)
    (tmp_path / "old").mkdir()
    save_file(old, str(tmp_path / "old" / "model.safetensors"))
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        await client.register("trainer", "t", address="127.0.0.1:1", capabilities=["memory"])
        await client.push_weights(shifted(base_state, 0.01), 1)
        await client.push_weights(old, 2)
        await client.rewind(1, "the trainer resumed from step 1")
        await client.push_weights(new, 2)  # the redone step 2: other bytes, the same number
        async with replica(rollout_model, codec, sync.address) as (core, link):
            # The replica was down during all this and holds the abandoned version 2.
            await link.arrival.updates.run(2, checkpoint_stage(str(tmp_path / "old"), 2, core.engine.weight_specs(),
                                                          tmp_path), None, 30)
            assert link.arrival.updates.identity == identify(old).digest != identify(new).digest
            link.start()
            await link.ready(5.0)
            # Registered with its identity: never taken as current; it installs the run's version 2.
            await eventually(lambda: link.arrival.updates.identity == identify(new).digest, what="the run's version 2 installed")
            await eventually(lambda: _not_quarantined(client), what="its update verified")
            assert core.status().version == 2
            records = await client.list_updates(2)
            assert records[-1].verified and records[-1].resident_identity == identify(new).digest


async def _quarantined(client: SynchronizerClient):
    c = await component(client)
    return c if c is not None and c.quarantined else None


async def _not_quarantined(client: SynchronizerClient) -> bool:
    c = await component(client)
    return c is not None and not c.quarantined and c.weight_identity != b""


async def _failed(client: SynchronizerClient, version: int) -> bool:
    return any(not r.verified for r in await client.list_updates(version))
