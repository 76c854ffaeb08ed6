"""The synchronizer process killed in the middle of a run: on restart (same
port, same store) component states, versions and the policy are back, the
components' heartbeat loops carry on, the trainer is asked to push the lost
bytes again, and the run continues."""

from __future__ import annotations

import asyncio

import torch

from flywheel.errors import FlywheelError
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.types import State
from tests.conftest import TEST_TOKEN
from flywheel.testing.net import free_port


async def until_up(client: SynchronizerClient, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await client.status()
        except FlywheelError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_restart_mid_run_recovers_state_and_the_run_continues(run_service, tmp_path) -> None:
    port = free_port()
    args = ("--server.port", str(port), "--store-path", str(tmp_path / "sync.sqlite3"), "--lease-seconds", "30")
    first = run_service("synchronizer", *args)
    address = f"127.0.0.1:{port}"
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    progress = {"trainer": (0, 0), "rollout": (0, 0)}
    async with SynchronizerClient(address, TEST_TOKEN, timeout=5) as t, SynchronizerClient(address, TEST_TOKEN, timeout=5) as r:
        await t.configure_policy("fixed", "memory", 10, 5)
        await t.register("trainer", "trainer", capabilities=["memory"])
        await r.register("rollout", "rollout", capabilities=["memory"])
        async with t.keep_alive("trainer", lambda: progress["trainer"], interval=0.2), \
                r.keep_alive("rollout", lambda: progress["rollout"], interval=0.2) as rollout_beats:
            assert (await t.need_sync("trainer", 10)).need_sync
            await t.push_weights(weights, 10)
            progress["trainer"] = (10, 10)
            d = await r.need_sync("rollout", 15)
            pulled = await r.pull_weights(d.version, at_least=True)
            await r.finish_sync("rollout", pulled.version)
            progress["rollout"] = (25, 10)
            assert (await r.need_sync("rollout", 25)).state == State.REQUIRE_SYNC  # awaiting version 20

            first.process.kill()  # no shutdown, no flush: a crash
            first.process.wait()
            second = run_service("synchronizer", *args)
            assert second.info["grpc_port"] == port

            status = await until_up(t)
            assert status.latest_version == 10 and [v.version for v in status.versions] == [10]
            assert not status.versions[0].in_memory  # the bytes died with the process
            assert (status.policy.interval, status.policy.offset) == (10, 5)
            assert {c.id: c.state for c in status.components} == {"trainer": State.RUNNING, "rollout": State.REQUIRE_SYNC}
            assert status.component("rollout").weight_version == 10
            # The components' own heartbeat loops found the synchronizer again.
            await asyncio.sleep(1.0)
            assert rollout_beats.last_error is None
            beat = await t.heartbeat("trainer", 12, 10)
            assert beat.push_requested and beat.state == State.RUNNING
            with_restore = await t.need_sync("trainer", 12)
            assert with_restore.need_sync and with_restore.push_requested
            await t.push_weights(weights, with_restore.version)  # bytes back (version 12 >= 10)
            assert (await t.status()).versions[-1].version == 12

            # ... and the run goes on: trainer step 20 publishes, the waiting rollout gets it.
            waiting = asyncio.ensure_future(r.pull_weights(20, at_least=True, wait_seconds=10))
            assert (await t.need_sync("trainer", 20)).need_sync
            await t.push_weights(weights, 20)
            pulled = await waiting
            assert pulled.version == 20 and torch.equal(pulled.tensors["w"], weights["w"])
            assert await r.finish_sync("rollout", 20) == State.RUNNING
            await asyncio.sleep(0.5)  # heartbeats still reporting version 10 do not undo it
            final = await t.status()
            assert final.component("rollout").weight_version == 20 and final.latest_version == 20
