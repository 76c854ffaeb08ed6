"""The trainer as a synchronizer component: the service registers itself with
the bound address and its export methods once loaded, heartbeats its step and
weight version past the lease, registers again after a synchronizer restart,
serves on while the synchronizer is down, and deregisters on a graceful stop.
A real in-process synchronizer and a tiny model; no doubles."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from flywheel.errors import Unavailable
from flywheel.runtime.server import RunningServer, serve
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.synchronizer.types import Method, Role, State
from services.trainer.app import build
from services.trainer.config import TrainerConfig
from services.trainer.link import TrainerLink
from services.trainer.loss_request import LossRequest
from flywheel.testing.net import free_port
from tests.unit.trainer.trainer_helpers import make_batch

TID = "trainer-under-test"
FAST = {"retry_initial_seconds": 0.05, "retry_max_seconds": 0.3, "rpc_timeout_seconds": 2.0}


async def eventually(check: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    """Polls an async or sync `check` until it returns something truthy. A synchronizer that
    has just come back may still be unreachable for a moment (a channel tries again about
    once a second): that is "not yet" too."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            try:
                value = await value
            except Unavailable:
                value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def component(client: SynchronizerClient, cid: str = TID):
    return (await client.status()).component(cid)


@contextlib.asynccontextmanager
async def trainer_service(tiny_model: Path, tmp_path: Path, address: str) -> AsyncIterator[RunningServer]:
    """The trainer service as `python -m services.trainer` runs it, on a free port."""
    config = TrainerConfig.model_validate({
        "server": {"port": 0, "metrics_port": 0, "shutdown_grace_seconds": 0.5},
        "model": {"path": str(tiny_model)},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "sync": {"synchronizer_address": address, "trainer_id": TID, **FAST},
    })
    stop = asyncio.Event()
    ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(build(config), config.server, stop=stop, on_ready=ready.set_result))
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    try:
        yield ready.result()
    finally:
        stop.set()
        await task


async def test_the_service_registers_itself_before_serving_and_deregisters_on_stop(tiny_model, tmp_path) -> None:
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        async with trainer_service(tiny_model, tmp_path, sync.address) as running:
            # Registered by the time it reports SERVING: a controller may ask NeedSync at once.
            c = await component(client)
            assert c is not None and c.role == Role.TRAINER and c.state == State.RUNNING
            assert c.identity.address == f"127.0.0.1:{running.grpc_port}"
            assert c.identity.capabilities == frozenset({Method.MEMORY, Method.CHECKPOINT, Method.NCCL})
            assert (c.step, c.weight_version) == (0, 0)
            assert (await client.need_sync(TID, 0)).need_sync is False  # known to the policy as a trainer
        assert (await component(client)).state == State.STOPPED


async def test_heartbeats_carry_the_engines_step_and_version_past_the_lease(make_engine) -> None:
    engine = make_engine()
    async with embedded_synchronizer(lease_seconds=0.6, sweep_interval_seconds=0.05) as sync, \
            SynchronizerClient(sync.address) as client:
        config = engine.config.model_copy(update={"sync": engine.config.sync.model_copy(
            update={"synchronizer_address": sync.address, "trainer_id": TID, **FAST})})
        link = TrainerLink(config, engine, grpc_port=50998)
        link.start()
        try:
            await link.presence.registered.wait()
            await asyncio.to_thread(engine.train_step, make_batch(), LossRequest(kind="grpo"))
            await asyncio.to_thread(engine.train_step, make_batch(seed=1), LossRequest(kind="grpo"))
            c = await eventually(
                lambda: _at(client, step=2), what="step 2 in a heartbeat"
            )
            assert c.weight_version == engine.info().weight_version == 2
            await asyncio.sleep(2.0)  # more than three leases
            assert (await component(client)).state == State.RUNNING, "heartbeats must keep the lease alive"
            assert link.presence.heartbeats.reregistrations == 0
        finally:
            await link.stop()
        assert (await component(client)).state == State.STOPPED


async def test_a_down_synchronizer_is_retried_and_a_restarted_one_gets_the_trainer_again(make_engine) -> None:
    engine = make_engine()
    port = free_port()
    config = engine.config.model_copy(update={"sync": engine.config.sync.model_copy(
        update={"synchronizer_address": f"127.0.0.1:{port}", "trainer_id": TID, **FAST})})
    link = TrainerLink(config, engine, grpc_port=50998)
    link.start()
    try:
        # Nobody listens yet: registration is retried with backoff, never raised.
        assert await link.presence.wait_registered(0.5) is False
        async with embedded_synchronizer(server={"port": port}, lease_seconds=0.6) as sync, \
                SynchronizerClient(sync.address) as client:
            c = await eventually(lambda: component(client), what="registration once the synchronizer is up")
            assert c.role == Role.TRAINER and c.identity.address == "127.0.0.1:50998"
        # The synchronizer stopped without a store: it forgets the trainer.
        await eventually(lambda: link.presence.heartbeats.last_error is not None, what="a failed heartbeat")
        await asyncio.to_thread(engine.train_step, make_batch(), LossRequest(kind="grpo"))
        async with embedded_synchronizer(server={"port": port}, lease_seconds=0.6) as again, \
                SynchronizerClient(again.address) as client:
            c = await eventually(lambda: _at(client, step=1), what="registration again after the restart")
            assert c.state == State.RUNNING and c.weight_version == 1
            assert link.presence.heartbeats.reregistrations >= 1
        # Stopped while the synchronizer is gone (a cluster stops every pod at once): the deregistration
        # gets one short deadline, not the retry policy's 3 s.
        started = time.monotonic()
        stopping, link = link, None
        await stopping.stop()
        assert time.monotonic() - started < 1.8
    finally:
        if link is not None:
            await link.stop()


async def _at(client: SynchronizerClient, *, step: int):
    c = await component(client)
    return c if c is not None and c.step == step else None
