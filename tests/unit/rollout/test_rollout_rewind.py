"""A rollout replica and a rewind: versions only go up, except when the synchronizer rewound
the run's weights; then a replica serving a version of the lost lineage holds its generations
back and installs the new lineage's version, although its number is lower (or the same).
A real synchronizer server and the transformers engine on a tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.errors import FailedPrecondition
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.participant import broadcast_version
from flywheel.synchronizer.types import TransferState
from flywheel.synchronizer.types import UpdateOutcome
from services.rollout.serving.core import RolloutCore
from services.rollout.weights.transaction import UpdateReport, WeightUpdates
from services.rollout.engine.transformers_engine import TransformersEngine
from services.rollout.weights.sources import checkpoint_stage
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.testing.net import free_port
from tests.unit.rollout.rollout_helpers import rollout_config
from tests.unit.rollout.test_rollout_follower import (
    CID, _at_version, component, eventually, generate, linked_rollout, shifted,
)


async def _update_of(client: SynchronizerClient, version: int, epoch: int):
    """The synchronizer's record of the replica's update to `version` in lineage `epoch` (None: none yet).
    Once it exists, the replica's own report of it was made: observers added after it miss nothing late."""
    return next((u for u in await client.list_updates(version) if u.component_id == CID and u.epoch == epoch), None)


@pytest.fixture
def base_state(rollout_model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(rollout_model / "model.safetensors"))


def first_weight(core: RolloutCore) -> torch.Tensor:
    return next(iter(core.engine.model.state_dict().values())).detach().float().clone()


async def _rewind_from_3_to_2(client: SynchronizerClient, core: RolloutCore, link) -> asyncio.Future:
    """Rewinds the run from version 3 (the replica's) to 2; the replica hears of it and holds back a
    generation asked for now, still on 3. Returns that generation."""
    rewound = await client.rewind(2, "the trainer resumed from step 2")
    assert (rewound.epoch, rewound.dropped, rewound.rewinding) == (1, [3], [CID])
    await eventually(lambda: link.follower.rewind_to == 2, what="the replica heard of the rewind")
    held = asyncio.ensure_future(generate(core, 0))
    await asyncio.sleep(0.5)
    assert not held.done(), "a generation must not run on the lost lineage's weights"
    assert core.status().version == 3
    return held


async def _back_on_2(client: SynchronizerClient, core: RolloutCore, link, held: asyncio.Future,
                     lineage: dict[str, torch.Tensor], reports: list[UpdateReport]) -> None:
    """The rewind's end: the held generation ran on version 2 of the new lineage (`lineage`'s weights),
    the replica reported it once and the synchronizer verified it, and the replica takes work."""
    assert (await asyncio.wait_for(held, 30)).version_start == 2
    assert core.status().version == 2 and link.follower.rewind_to is None
    assert torch.allclose(first_weight(core), next(iter(lineage.values())).float())
    await eventually(lambda: _at_version(client, 2), what="version 2 reported back")
    assert [(r.version, r.error) for r in reports] == [(2, None)]
    judged = await eventually(lambda: _update_of(client, 2, 1), what="the update to version 2 recorded")
    assert judged.verified, judged.reason  # the new lineage's version 2 is what was published again
    assert not (await component(client)).quarantined


async def test_the_core_installs_an_older_version_only_for_a_rewind(rollout_model, codec, base_state, tmp_path) -> None:
    config = rollout_config(rollout_model, "transformers")
    engine = TransformersEngine(rollout_model, dict(config.engine.args), codec)
    await engine.start()
    try:
        core = RolloutCore(config, engine, codec, "tiny")
        updates = WeightUpdates(core, config)
        specs = engine.weight_specs()
        for version in (2, 3):
            (tmp_path / f"v{version}").mkdir()
            save_file(shifted(base_state, 0.01 * version), str(tmp_path / f"v{version}" / "model.safetensors"))
        await updates.run(3, checkpoint_stage(str(tmp_path / "v3"), 3, specs, tmp_path), None, 30)
        for version in (2, 3):
            with pytest.raises(FailedPrecondition, match=f"version {version} is not newer than the served version 3"):
                await updates.run(version, checkpoint_stage(str(tmp_path / "v2"), version, specs, tmp_path), None, 30)
        assert core.status().version == 3
        await updates.run(2, checkpoint_stage(str(tmp_path / "v2"), 2, specs, tmp_path), None, 30, rewind=True)
        assert core.status().version == 2
        assert (await generate(core)).version_start == 2
    finally:
        await engine.stop()


async def test_a_replica_on_a_lost_version_goes_back_to_the_rewound_one(rollout_model, codec, base_state) -> None:
    """Versions 1-3 made, 3 lost with the trainer: rewound to 2, the replica (on 3) holds generation
    back until the trainer publishes 2 again (its bytes were evicted), installs it, and reports 2;
    the new lineage's 3 (other weights) follows as an ordinary update."""
    async with embedded_synchronizer(keep_versions=1) as sync, SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            for version in (1, 2, 3):
                await client.push_weights(shifted(base_state, 0.01 * version), version)
                # One at a time: with keep_versions 1, a version pushed before the replica pulled the
                # previous one evicts it, and a failed pull waits for the next sync request (1 run in 6).
                await link.follower.reach(version, 30)
            await eventually(lambda: _update_of(client, 3, 0), what="version 3 reported")
            reports: list[UpdateReport] = []
            link.arrival.updates.observers.append(reports.append)

            held = await _rewind_from_3_to_2(client, core, link)

            lineage = shifted(base_state, 0.5)  # the checkpoint's weights, published again as version 2
            await client.push_weights(lineage, 2)
            await _back_on_2(client, core, link, held, lineage, reports)

            await client.push_weights(shifted(base_state, 0.6), 3)  # the new lineage goes on: an ordinary update
            await link.follower.reach(3, 30)
            assert torch.allclose(first_weight(core), next(iter(shifted(base_state, 0.6).values())).float())
            status = await client.status()
            assert (status.epoch, status.rewound_to) == (1, 2)


async def test_a_replica_that_missed_the_rewind_event_goes_back_at_the_next_event(rollout_model, codec,
                                                                                   base_state) -> None:
    """An event of a newer lineage (its Watch was down during the rewind) is enough to go back."""
    from flywheel.synchronizer.client_types import WatchEvent
    from flywheel.synchronizer.types import EventKind

    async with embedded_synchronizer(keep_versions=3) as sync, SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            for version in (1, 2, 3):
                await client.push_weights(shifted(base_state, 0.01 * version), version)
            await link.follower.reach(3, 30)
            await client.rewind(2)
            await eventually(lambda: core.status().version == 2, what="back on version 2")
            # Replayed as if missed: an ordinary event that carries the lineage (epoch 1, rewound to 2).
            link.follower.epoch = 0
            await client.push_weights(shifted(base_state, 0.7), 3)
            await link.follower.reach(3, 30)
            link.follower.epoch = 0
            link.follower.learn(WatchEvent(EventKind.STATE_CHANGED, 1, 0, 3, None, 0, None, "", None, None, "", 1, 2))
            assert link.follower.rewind_to == 2  # serving 3 (perhaps of the lost lineage): it goes back
            await eventually(lambda: link.follower.rewind_to is None, what="the rewind done")
            assert core.status().version == 3  # the new lineage's newest, installed again


async def test_a_replica_on_a_lost_nccl_version_is_broadcast_the_rewound_one(rollout_model, codec, base_state) -> None:
    """NCCL (gloo on CPU, the trainer's rank in a thread here): versions 1-3 broadcast, 3 lost with the
    trainer. Nothing can be pulled: after Rewind(2) the trainer broadcasts 2 again, the synchronizer
    puts the replica (on 3) in the group although its number is higher, and the replica installs 2
    in place of 3 and reports it."""
    port = free_port()  # one rendezvous port, free now, for every transfer in turn
    async with embedded_synchronizer(group_backend="gloo", rendezvous_host="127.0.0.1", rendezvous_port_min=port,
                                     rendezvous_port_max=port) as sync, \
            SynchronizerClient(sync.address) as client:
        await client.configure_policy("fixed", "nccl", 1)
        await client.register("trainer", "trainer-0")
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            for version in (1, 2, 3):
                sent = await broadcast_version(client, "trainer-0", version, shifted(base_state, 0.01 * version),
                                               timeout_seconds=30)
                assert sent.state == TransferState.COMMITTED, sent.error
                await eventually(lambda: core.status().version == version, what=f"version {version} installed")
            await eventually(lambda: _update_of(client, 3, 0), what="version 3 reported")
            reports: list[UpdateReport] = []
            link.arrival.updates.observers.append(reports.append)

            held = await _rewind_from_3_to_2(client, core, link)
            assert link.follower.rewind_to == 2  # nothing to pull: it waits

            lineage = shifted(base_state, 0.5)  # the checkpoint's weights, broadcast again as version 2
            sent = await broadcast_version(client, "trainer-0", 2, lineage, timeout_seconds=30)
            assert sent.state == TransferState.COMMITTED, sent.error
            assert sent.group is not None and sent.group.ranks == {"trainer-0": 0, CID: 1}
            await _back_on_2(client, core, link, held, lineage, reports)
            status = await client.status()
            assert (status.epoch, status.rewound_to, status.latest_version) == (1, 2, 2)


async def test_when_the_run_starts_over_a_replica_reloads_the_weights_it_started_with(rollout_model, codec,
                                                                                      base_state) -> None:
    """The trainer died before its first checkpoint and came back on the base model: Rewind(0). The
    replica, on version 2 of the lost lineage, reloads its own model directory, reports version 0
    (which the synchronizer takes as its way back), and the new lineage's version 1 follows as an
    ordinary update."""
    async with embedded_synchronizer(keep_versions=3) as sync, SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            started_with = first_weight(core)
            for version in (1, 2):
                await client.push_weights(shifted(base_state, 0.01 * version), version)
                await link.follower.reach(version, 30)
            assert not torch.equal(first_weight(core), started_with)
            await eventually(lambda: _update_of(client, 2, 0), what="version 2 reported")
            reports: list[UpdateReport] = []
            link.arrival.updates.observers.append(reports.append)

            rewound = await client.rewind(0, "the trainer restarted before its first checkpoint")
            assert (rewound.epoch, rewound.latest_version, rewound.dropped) == (1, 0, [1, 2])
            assert rewound.rewinding == ["rollout-under-test"]
            await eventually(lambda: core.status().version == 0 and link.follower.rewind_to is None,
                             what="back on the base weights")
            assert torch.equal(first_weight(core), started_with)
            assert [(r.version, r.error) for r in reports] == [(0, None)]
            assert (await generate(core, 0)).version_start == 0
            await eventually(lambda: _at_version(client, 0), what="version 0 reported back")

            async def recorded() -> list:
                return [u for u in await client.list_updates() if (u.version, u.epoch) == (0, 1)]

            # The replica measured every tensor against the base model's files; the synchronizer never
            # recorded the base model's identity, so it cannot judge it VERIFIED (nor quarantines for it).
            [judged] = await eventually(recorded, what="the update to version 0 recorded")
            assert judged.outcome == UpdateOutcome.UNVERIFIED and judged.coverage.complete
            assert not (await component(client)).quarantined

            await client.push_weights(shifted(base_state, 0.3), 1)  # the new lineage's first step
            await link.follower.reach(1, 30)
            assert torch.allclose(first_weight(core), next(iter(shifted(base_state, 0.3).values())).float())
            status = await client.status()
            assert (status.epoch, status.rewound_to, status.latest_version) == (1, 0, 1)


def test_a_replica_started_on_a_later_version_cannot_go_back_to_the_base_model(rollout_model) -> None:
    from services.rollout.config import EngineConfig
    from services.rollout.weights.sources import base_stage

    with pytest.raises(FailedPrecondition, match="holds version 3 .*engine.initial_version.*restart it on the base"):
        base_stage(EngineConfig(model_path=rollout_model, initial_version=3), {})
    with pytest.raises(FailedPrecondition, match="no engine.model_path"):
        base_stage(EngineConfig(), {})
