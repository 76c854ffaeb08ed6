"""The synchronizer's sync policies end to end: a real gRPC server and real
clients playing a trainer and a rollout, with the states they go through
recorded from the Watch stream."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
import torch

from flywheel.errors import FailedPrecondition
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.synchronizer.types import EventKind, Role, State

R, Q, W, S = State.RUNNING, State.REQUIRE_SYNC, State.WAITING_SYNC, State.STOPPED


class StateLog:
    """Per component, the sequence of distinct states Watch reported."""

    def __init__(self, client: SynchronizerClient) -> None:
        self.states: dict[str, list[State]] = defaultdict(list)
        self.versions: dict[str, list[int]] = defaultdict(list)
        self.events = []
        self.task = asyncio.ensure_future(self._run(client))

    async def _run(self, client: SynchronizerClient) -> None:
        async for event in client.watch(send_initial=False):
            self.events.append(event)
            c = event.component
            if c is None:
                continue
            if not self.states[c.id] or self.states[c.id][-1] != c.state:
                self.states[c.id].append(c.state)
            if not self.versions[c.id] or self.versions[c.id][-1] != c.weight_version:
                self.versions[c.id].append(c.weight_version)

    async def close(self) -> None:
        await asyncio.sleep(0.2)  # let the last events arrive
        self.task.cancel()


async def run_fixed(address: str, method: str, interval: int, offset: int, steps: int = 40) -> StateLog:
    state = {"w": torch.arange(64, dtype=torch.float32)}
    async with SynchronizerClient(address) as ctl, SynchronizerClient(address) as tc, SynchronizerClient(address) as rc:
        await ctl.configure_policy("fixed", method, interval, offset)
        log = StateLog(ctl)
        await asyncio.sleep(0.1)
        await tc.register(Role.TRAINER, "trainer", capabilities=[method])
        await rc.register(Role.ROLLOUT, "rollout", capabilities=[method])
        batches: asyncio.Queue[int] = asyncio.Queue()

        async def trainer() -> None:
            for step in range(1, steps + 1):
                assert await batches.get() == step  # trains on the rollout's step-`step` data
                d = await tc.need_sync("trainer", step)
                if not d.need_sync:
                    continue
                if method == "memory":
                    await tc.push_weights(state, d.version)
                else:
                    assert d.state == W
                    group = await tc.allocate_group(d.version, "trainer", ["rollout"], timeout_seconds=30)
                    await tc.report_transfer(group.group_id, "trainer", True)
                    outcome = await tc.get_transfer(group.group_id, wait_seconds=30)
                    assert outcome.state.name == "COMMITTED", (step, outcome)

        async def rollout() -> None:
            # `offset` steps ahead of the trainer: it serves the trainer's 40th step at its 40 + offset.
            for step in range(1, steps + offset + 1):
                batches.put_nowait(step)
                d = await rc.need_sync("rollout", step)
                if not d.need_sync:
                    continue
                assert d.state == Q
                if method == "memory":
                    pulled = await rc.pull_weights(d.version, wait_seconds=30, at_least=True)
                    assert torch.equal(pulled.tensors["w"], state["w"])
                    await rc.finish_sync("rollout", pulled.version)
                else:
                    while d.group is None:  # the trainer has not allocated the group yet
                        await asyncio.sleep(0.01)
                        d = await rc.need_sync("rollout", step)
                    await rc.set_state("rollout", W, expected=Q)
                    await rc.report_transfer(d.group.group_id, "rollout", True)
                    assert (await rc.get_transfer(d.group.group_id, wait_seconds=30)).state.name == "COMMITTED"

        await asyncio.wait_for(asyncio.gather(trainer(), rollout()), 60)
        await log.close()
        return log


@pytest.mark.parametrize("method", ["memory", "nccl"])
@pytest.mark.parametrize("interval, offset", [(10, 0), (10, 5)])
async def test_fixed_policy_state_tables_over_40_steps(method: str, interval: int, offset: int) -> None:
    async with embedded_synchronizer() as server:
        log = await run_fixed(server.address, method, interval, offset)
    # Trainer steps 10, 20, 30, 40; rollout steps 10, 20, 30, 40 (offset 0) or
    # 15, 25, 35, 45 (offset 5), each time to the version of trainer step - offset.
    if method == "memory":
        assert log.states["trainer"] == [R]
        assert log.states["rollout"] == [R] + [Q, R] * 4
    else:
        assert log.states["trainer"] == [R] + [W, R] * 4
        assert log.states["rollout"] == [R] + [Q, W, R] * 4
    assert log.versions["rollout"] == [0, 10, 20, 30, 40]
    requested = [(e.component.step, e.version) for e in log.events if e.kind == EventKind.SYNC_REQUESTED]
    assert requested == [(s + offset, s) for s in (10, 20, 30, 40)]


async def test_dynamic_request_times_out_then_is_asked_again_and_served() -> None:
    async with embedded_synchronizer(sweep_interval_seconds=0.05) as server:
        async with SynchronizerClient(server.address) as tc, SynchronizerClient(server.address) as rc:
            await tc.configure_policy("dynamic_by_explorer", "memory", interval=3, timeout_seconds=0.5)
            log = StateLog(tc)
            await asyncio.sleep(0.1)
            await tc.register("trainer", "trainer")
            await rc.register("rollout", "rollout")
            assert not (await rc.need_sync("rollout", 2)).need_sync
            d = await rc.need_sync("rollout", 3)
            assert d.need_sync and d.state == Q and d.version == 1 and d.request_deadline_unix_ms > time.time() * 1000
            # The trainer is busy and never looks: the request lapses ...
            await asyncio.sleep(1.0)
            assert (await rc.heartbeat("rollout", 3)).state == R
            # ... and the rollout asks again on its next step; this time the trainer sees it.
            assert (await rc.need_sync("rollout", 4)).state == Q
            pull = asyncio.ensure_future(rc.pull_weights(1, wait_seconds=10, at_least=True))
            td = await tc.need_sync("trainer", 6)
            assert td.need_sync and td.version == 6
            await tc.push_weights({"w": torch.ones(8)}, 6)
            pulled = await pull
            assert pulled.version == 6
            await rc.finish_sync("rollout", pulled.version)
            assert not (await tc.need_sync("trainer", 7)).need_sync  # request served
            assert not (await rc.need_sync("rollout", 6)).need_sync  # 3 steps since its request at 4
            assert (await rc.need_sync("rollout", 7)).need_sync
            await log.close()
    assert log.states["rollout"] == [R, Q, R, Q, R, Q]
    lapsed = [e for e in log.events if e.component and e.component.id == "rollout" and "timed out" in e.message]
    assert len(lapsed) == 1


async def test_illegal_transitions_are_rejected_naming_both_states() -> None:
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        await c.register("trainer", "t")
        await c.register("rollout", "r")
        await c.register("controller", "ctl")
        for cid, to, frm in [("r", W, R), ("t", Q, R), ("ctl", Q, R)]:
            with pytest.raises(FailedPrecondition, match=f"illegal transition {frm.name} -> {to.name}") as info:
                await c.set_state(cid, to)
            assert info.value.code == "FAILED_PRECONDITION"
        with pytest.raises(FailedPrecondition, match="is RUNNING, not WAITING_SYNC"):
            await c.set_state("r", R, expected=W)
        assert await c.set_state("r", Q) == Q and await c.set_state("r", W) == W
        with pytest.raises(FailedPrecondition, match="WAITING_SYNC -> REQUIRE_SYNC"):
            await c.set_state("r", Q)
        await c.set_state("t", S)
        with pytest.raises(FailedPrecondition, match="STOPPED -> WAITING_SYNC"):
            await c.set_state("t", W)
        status = await c.status()
        assert [(x.id, x.state) for x in status.components] == [("t", S), ("r", W), ("ctl", R)]
        text = status.describe()
        assert "policy: fixed interval=1" in text and "r" in text and "WAITING_SYNC" in text
