"""The rollout as a synchronizer component: it registers with its served
version, stays alive past the lease, registers again after a synchronizer
restart, reports every weight update (who ever asked for it, failures with
their reason), moves its weights only as the policy directs at its own steps
(FIXED points, DYNAMIC requests that lapse and are asked again), holds
generations back by the policy's wait rule, catches up when it joins, and
deregisters on a graceful stop. A real synchronizer server and the
transformers engine on a tiny model; no doubles."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.errors import Aborted, FailedPrecondition
from flywheel.runtime.server import RunningServer, serve
from services.rollout.serving.core import RolloutCore
from services.rollout.weights.arrival import WeightArrival
from services.rollout.weights.transaction import UpdateReport, WeightUpdates
from services.rollout.engine.base import SampleOutput, SamplingSpec
from services.rollout.engine.transformers_engine import TransformersEngine
from services.rollout.serving.prompts import ResolvedPrompt
from services.rollout.weights.link import SynchronizerLink
from services.rollout.weights.sources import checkpoint_stage
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import WatchEvent
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.synchronizer.types import EventKind, Method, Role, State
from flywheel.testing.net import free_port
from tests.unit.rollout.rollout_helpers import rollout_config

CID = "rollout-under-test"


async def eventually(check: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    """Polls an async or sync `check` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def base_state(rollout_model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(rollout_model / "model.safetensors"))


def shifted(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: (v.float() + by).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def link_config(model: Path, address: str, **link: object):
    return rollout_config(model, "transformers", synchronizer={
        "address": address, "component_id": CID, "retry_initial_seconds": 0.05, "retry_max_seconds": 0.3,
        "rpc_timeout_seconds": 2.0, **link,
    })


@contextlib.asynccontextmanager
async def linked_rollout(model: Path, codec, address: str, **link: object) -> AsyncIterator[tuple[RolloutCore, SynchronizerLink]]:
    """A loaded rollout core and its started link (no gRPC server of its own: the link is under test)."""
    config = link_config(model, address, **link)
    engine = TransformersEngine(model, dict(config.engine.args), codec)
    await engine.start()
    core = RolloutCore(config, engine, codec, "tiny")
    link_ = SynchronizerLink(config, WeightArrival(WeightUpdates(core, config), config, None), grpc_port=50999)
    link_.start()
    try:
        yield core, link_
    finally:
        await link_.stop()
        await engine.stop()


@contextlib.asynccontextmanager
async def linked_under_policy(
    model: Path, codec, *policy: object, synchronizer: dict | None = None, **policy_fields: object
) -> AsyncIterator[tuple[SynchronizerClient, RolloutCore, SynchronizerLink]]:
    """A synchronizer (`synchronizer`: its settings) whose policy is `configure_policy(*policy,
    **policy_fields)`, a client of it, and a rollout linked to it and ready: (client, core, link)."""
    async with embedded_synchronizer(**(synchronizer or {})) as sync, SynchronizerClient(sync.address) as client:
        await client.configure_policy(*policy, **policy_fields)
        async with linked_rollout(model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            yield client, core, link


async def component(client: SynchronizerClient, cid: str = CID):
    return (await client.status()).component(cid)


async def collect(client: SynchronizerClient, into: list[WatchEvent]) -> None:
    async for event in client.watch([CID], send_initial=False):
        into.append(event)


@contextlib.asynccontextmanager
async def watching(client: SynchronizerClient) -> AsyncIterator[list[WatchEvent]]:
    """The rollout's events on Watch while the block runs, in a list that fills as they come."""
    events: list[WatchEvent] = []
    watcher = asyncio.ensure_future(collect(client, events))
    await asyncio.sleep(0.2)  # subscribed before the block acts
    try:
        yield events
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_registers_with_its_served_version_and_heartbeats_past_the_lease(rollout_model, codec) -> None:
    async with embedded_synchronizer(lease_seconds=0.6, sweep_interval_seconds=0.05) as sync, \
            SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            c = await eventually(lambda: component(client), what="registration")
            assert c.role == Role.ROLLOUT and c.state == State.RUNNING
            assert c.identity.address == "127.0.0.1:50999"
            assert c.identity.capabilities == frozenset({Method.MEMORY, Method.CHECKPOINT, Method.NCCL})
            assert c.weight_version == core.status().version == 0
            await asyncio.sleep(2.0)  # more than three leases
            c = await component(client)
            assert c.state == State.RUNNING, "heartbeats must keep the lease alive"
            assert link.presence.heartbeats.reregistrations == 0
        # Stopping the link deregisters at once, long before the lease could run out.
        assert (await component(client)).state == State.STOPPED


async def test_a_restarted_synchronizer_gets_the_rollout_registered_again(rollout_model, codec) -> None:
    port = free_port()
    first = embedded_synchronizer(server={"port": port}, lease_seconds=0.6)  # no store: it forgets everything
    sync = await first.__aenter__()
    try:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            async with SynchronizerClient(sync.address) as client:
                await eventually(lambda: component(client), what="first registration")
            await first.__aexit__(None, None, None)
            first = None
            # Down: heartbeats fail (and are retried), the rollout serves on.
            await eventually(lambda: link.presence.heartbeats.last_error is not None, what="a failed heartbeat")
            assert core.status().engine == "transformers"
            async with embedded_synchronizer(server={"port": port}, lease_seconds=0.6) as again, \
                    SynchronizerClient(again.address) as client:
                c = await eventually(lambda: component(client), what="registration after the restart")
                assert c.state == State.RUNNING and c.identity.address == "127.0.0.1:50999"
                assert link.presence.heartbeats.reregistrations >= 1
    finally:
        if first is not None:
            await first.__aexit__(None, None, None)


async def test_a_restarted_synchronizer_is_told_again_which_version_the_rollout_proved(
    rollout_model, codec, base_state,
) -> None:
    """The proof of the version served went to the synchronizer that died (its ledger is memory only).
    Registered again, the rollout sends it again, and the new synchronizer judges it once the version
    is recorded there again (the controller has the trainer publish it): a train step waiting for that
    proof gets it, and the rollout installs nothing a second time."""
    port = free_port()
    first = embedded_synchronizer(server={"port": port}, lease_seconds=0.6)  # no store: it forgets everything
    sync = await first.__aenter__()
    try:
        async with SynchronizerClient(sync.address) as client:
            await client.configure_policy("fixed", "memory", 1, 0, 30.0, rollout_wait="due_version")
            async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
                await link.ready(5.0)
                await client.push_weights(shifted(base_state, 0.01), 1)
                assert (await generate(core, 2)).version_start == 1
                [proved] = await eventually(lambda: client.list_updates(1), what="version 1's report")
                assert proved.verified
                installs: list[UpdateReport] = []
                link.arrival.updates.observers.append(installs.append)
                await first.__aexit__(None, None, None)
                first = None
                await eventually(lambda: link.presence.heartbeats.last_error is not None, what="a failed heartbeat")
                async with embedded_synchronizer(server={"port": port}, lease_seconds=0.6) as again, \
                        SynchronizerClient(again.address) as client2:
                    await eventually(lambda: component(client2), what="registration after the restart")
                    await asyncio.sleep(1.0)  # its proof is refused meanwhile: version 1 is not recorded here yet
                    assert await client2.list_updates(1) == []
                    await client2.push_weights(shifted(base_state, 0.01), 1)  # as the trainer publishes it again
                    [told] = await eventually(lambda: client2.list_updates(1), 15.0, what="the proof told again")
                    assert told.component_id == CID and told.verified, told
                    assert told.resident_identity == proved.resident_identity
                    assert core.status().version == 1 and not core.quarantine_reason
                    assert installs == [], "nothing is installed again"
    finally:
        if first is not None:
            await first.__aexit__(None, None, None)


async def test_an_update_anyone_triggers_is_reported(rollout_model, codec, base_state, tmp_path: Path) -> None:
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    save_file(shifted(base_state, 0.01), str(ckpt / "model.safetensors"))
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.presence.registered.wait()
            specs = core.engine.weight_specs()
            # As UpdateWeights (the operator's path) does it: the core, with a checkpoint.
            await link.arrival.updates.run(1, checkpoint_stage(str(ckpt), 1, specs, tmp_path), None, 30)
            c = await eventually(lambda: _at_version(client, 1), what="version 1 reported")
            assert c.state == State.RUNNING


async def _at_version(client: SynchronizerClient, version: int):
    c = await component(client)
    return c if c is not None and c.weight_version == version else None


async def generate(core: RolloutCore, run_step: int = 0, min_version: int = 0) -> SampleOutput:
    prompt = ResolvedPrompt(ids=[1, 2, 3], request_id="")
    # Bounded: a generation once waited here until the suite's 600 s timeout, under load (a loop idle,
    # nothing left to wake it); this fails at once, at the call that waits.
    (out,) = await asyncio.wait_for(
        core.generate([prompt], SamplingSpec(max_tokens=2), run_step=run_step, min_version=min_version), 60.0)
    return out.samples[0]


def states(events: list[WatchEvent]) -> list[str]:
    """The rollout's state after each state event, collapsing repeats."""
    seen: list[str] = []
    for e in events:
        if e.component is not None and e.kind in (EventKind.STATE_CHANGED, EventKind.SYNC_REQUESTED):
            name = e.component.state.name
            if not seen or seen[-1] != name:
                seen.append(name)
    return seen


async def test_fixed_sync_points_hold_generation_for_the_due_version(rollout_model, codec, base_state) -> None:
    """FIXED(2, 1), sync mode: steps 3, 5 are sync points, due versions 2 and 4; nothing moves in between."""
    async with linked_under_policy(rollout_model, codec, "fixed", "memory", 2, 1, 30.0, rollout_wait="due_version",
                                   synchronizer={"keep_versions": 4}) as (client, core, link):
        async with watching(client) as events:
            for version in (1, 2):
                await client.push_weights(shifted(base_state, 0.01 * version), version)
            # Steps 1 and 2 completed (run steps 2, 3): no sync point yet, even with newer versions around.
            for run_step in (1, 2, 3):
                assert (await generate(core, run_step)).version_start == 0
            assert core.status().version == 0 and link.follower.step == 2
            # Run step 4: step 3 is a sync point; it waits for version 2 and serves it.
            push3 = asyncio.ensure_future(client.push_weights(shifted(base_state, 0.03), 3))
            assert (await generate(core, 4)).version_start == 2
            await push3
            assert (await generate(core, 5)).version_start == 2  # step 4: not a sync point
            # Step 5 is due version 4, not pushed yet: the generation waits for it.
            waiting = asyncio.ensure_future(generate(core, 6))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await client.push_weights(shifted(base_state, 0.04), 4)
            assert (await asyncio.wait_for(waiting, 30)).version_start == 4
            # The engine serves the pushed bytes, not just a new number.
            served = core.engine.model.state_dict()
            name = next(n for n, t in base_state.items() if t.is_floating_point() and n in served)
            assert torch.equal(served[name].to(base_state[name].dtype), shifted(base_state, 0.04)[name])
            await eventually(lambda: _at_version(client, 4), what="version 4 reported")
            # The seed table for MEMORY: RUNNING -> REQUIRE_SYNC -> RUNNING at each sync point.
            assert states(events) == ["REQUIRE_SYNC", "RUNNING", "REQUIRE_SYNC", "RUNNING"]
            assert (await component(client)).step == 5


async def test_a_staleness_bound_waits_only_while_too_far_behind(rollout_model, codec, base_state) -> None:
    async with linked_under_policy(rollout_model, codec, "fixed", "memory", 1, 0, 2.0, rollout_wait="staleness",
                                   max_staleness=1, synchronizer={"keep_versions": 4}) as (client, core, link):
        assert (await generate(core, 2)).version_start == 0  # trained against 1: 1 behind is allowed
        # Run step 3 needs version >= 1; FIXED(1, 0) asks for version 2 at step 2, and it is not out yet:
        # the generation is refused at the policy's timeout rather than run 2 behind.
        with pytest.raises(Aborted, match="needs version 1"):
            await generate(core, 3)
        await client.push_weights(shifted(base_state, 0.01), 1)
        assert (await generate(core, 3)).version_start == 1
        # Step 3 is due version 3, not out yet; version 2 is, and is all run step 4 needs:
        # a step towards the due version is progress, and the generation runs on it.
        await client.push_weights(shifted(base_state, 0.02), 2)
        assert (await generate(core, 4)).version_start == 2


async def test_a_dynamic_request_that_lapses_is_asked_again_at_the_next_step(rollout_model, codec, base_state) -> None:
    async with linked_under_policy(rollout_model, codec, "dynamic_by_explorer", "memory", 2, 0, 0.5, rollout_wait="none",
                                   synchronizer={"sweep_interval_seconds": 0.05}) as (client, core, link):
        async with watching(client) as events:
            await generate(core, 2)  # step 1: not yet
            await generate(core, 3)  # step 2: asks for a version newer than 0
            assert (await component(client)).state == State.REQUIRE_SYNC
            requested = await eventually(lambda: [e for e in events if e.kind == EventKind.SYNC_REQUESTED],
                                         what="the request on Watch")
            assert requested[0].version == 1  # anything newer than the served version 0
            await eventually(lambda: states(events)[-1:] == ["RUNNING"], what="the request to lapse")
            assert any("timed out" in e.message for e in events)
            await generate(core, 4)  # step 3: asks again
            assert (await component(client)).state == State.REQUIRE_SYNC
            await client.push_weights(shifted(base_state, 0.01), 1)
            await eventually(lambda: _at_version(client, 1), what="version 1 applied and reported")
            assert (await component(client)).state == State.RUNNING
            assert states(events) == ["REQUIRE_SYNC", "RUNNING", "REQUIRE_SYNC", "RUNNING"]


async def test_a_replica_that_joins_catches_up_to_the_newest_version_first(rollout_model, codec, base_state) -> None:
    async with embedded_synchronizer(keep_versions=3) as sync, SynchronizerClient(sync.address) as client:
        for version in (1, 2, 3):  # committed before the rollout hears of any
            await client.push_weights(shifted(base_state, 0.01 * version), version)
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            reports: list[UpdateReport] = []
            link.arrival.updates.observers.append(reports.append)
            await link.ready(5.0)
            assert core.status().version == 3, "caught up before it reports ready"
            assert [(r.version, r.error) for r in reports] == [(3, None)], "versions 1 and 2 must be skipped"
            await eventually(lambda: _at_version(client, 3), what="version 3 reported")


async def test_a_failed_update_is_reported_with_its_reason_and_the_old_version_kept(rollout_model, codec, base_state) -> None:
    name = next(n for n, t in base_state.items() if t.dim() == 2)
    wrong = dict(base_state)
    wrong[name] = torch.zeros(wrong[name].shape[0] + 1, wrong[name].shape[1], dtype=wrong[name].dtype)
    async with linked_under_policy(rollout_model, codec, "fixed", "memory", 1, 0, 1.0,
                                   rollout_wait="due_version") as (client, core, link):
        async with watching(client) as events:
            await client.push_weights(wrong, 1)
            with pytest.raises(Aborted):
                await generate(core, 2)  # due version 1 cannot be applied: refused, never served half-updated

            def failure() -> WatchEvent | None:
                return next((e for e in events if e.kind == EventKind.STATE_CHANGED and "failed" in e.message), None)

            event = await eventually(failure, what="the failure on Watch")
            assert "version 1" in event.message and "still serving version 0" in event.message
            assert "INVALID_ARGUMENT" in event.message and name in event.message
            assert event.component.weight_version == 0
            assert core.status().version == 0
            # The next good version is applied: one bad push does not stop following.
            await client.push_weights(shifted(base_state, 0.02), 2)
            assert (await generate(core, 3)).version_start == 2
            await eventually(lambda: _at_version(client, 2), what="version 2 reported")


async def test_a_version_evicted_before_it_was_pulled_is_passed_over_for_the_newest(
    rollout_model, codec, base_state, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_versions 1: a push lands while the replica sets out to pull the version before it, which
    is gone (NOT_FOUND). It pulls the newest at once instead of waiting for another sync request."""
    async with embedded_synchronizer(keep_versions=1) as sync, SynchronizerClient(sync.address) as client:
        async with linked_rollout(rollout_model, codec, sync.address) as (core, link):
            await link.ready(5.0)
            follower = link.follower
            source_for = follower._source_for
            failures: list[UpdateReport] = []
            link.arrival.updates.observers.append(lambda r: failures.append(r) if r.error is not None else None)

            async def pushed_over(version: int):
                if version == 1:
                    await client.push_weights(shifted(base_state, 0.02), 2)  # evicts version 1
                return await source_for(version)

            monkeypatch.setattr(follower, "_source_for", pushed_over)
            await client.push_weights(shifted(base_state, 0.01), 1)
            await eventually(lambda: follower.latest >= 1, what="version 1 heard")
            await follower.reach(1, 30.0)
            assert core.status().version == 2
            assert [(r.version, getattr(r.error, "code", "")) for r in failures] == [(1, "NOT_FOUND")]
            await eventually(lambda: _at_version(client, 2), what="version 2 reported")


async def test_min_weight_version_without_a_synchronizer_is_refused(rollout_model, codec) -> None:
    config = rollout_config(rollout_model, "transformers")
    engine = TransformersEngine(rollout_model, dict(config.engine.args), codec)
    await engine.start()
    core = RolloutCore(config, engine, codec, "tiny")
    try:
        with pytest.raises(FailedPrecondition, match="no synchronizer"):
            await generate(core, min_version=1)
        assert (await generate(core, run_step=7)).version_start == 0  # steps mean nothing standalone
    finally:
        await engine.stop()


async def test_the_service_registers_once_loaded_and_deregisters_on_graceful_stop(rollout_model) -> None:
    async with embedded_synchronizer(lease_seconds=30) as sync, SynchronizerClient(sync.address) as client:
        from services.rollout.app import build

        config = link_config(rollout_model, sync.address)
        stop = asyncio.Event()
        ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(serve(build(config), config.server, stop=stop, on_ready=ready.set_result))
        running = await asyncio.wait_for(ready, 120)
        try:
            c = await eventually(lambda: component(client), what="registration")
            assert c.identity.address == f"127.0.0.1:{running.grpc_port}", "the bound port, not the configured 0"
            assert c.state == State.RUNNING
        finally:
            stop.set()
            await task
        assert (await component(client)).state == State.STOPPED
