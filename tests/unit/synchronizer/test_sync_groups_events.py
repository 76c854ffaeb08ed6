"""Transfer groups (commit/abort rules, ports, deadlines) and the Watch fan-out."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.synchronizer.events import EventBus
from services.synchronizer.groups import Group, Transfers
from flywheel.synchronizer.types import Component, EventKind, Identity, Role, TransferState

T = Component(Identity(Role.TRAINER, "t", "10.1.2.3:50052"))
R1, R2 = Component(Identity(Role.ROLLOUT, "r1")), Component(Identity(Role.ROLLOUT, "r2", labels={"device": "cuda:0"}))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def transfers(ports: range = range(30000, 30003), backend: str = "auto") -> tuple[Transfers, list[Group], Clock]:
    finished: list[Group] = []
    clock = Clock()
    t = Transfers(host="", ports=ports, default_timeout=10, default_backend=backend, on_finish=finished.append, clock=clock)
    return t, finished, clock


def test_commit_needs_every_member_the_sender_too() -> None:
    t, finished, _ = transfers()
    g = t.allocate(7, T, [R1, R2], 0, "")
    assert g.members == [("t", 0), ("r1", 1), ("r2", 2)] and g.world_size == 3
    assert g.rendezvous_address == "10.1.2.3:30000" and g.backend == "gloo"  # r1 is not on cuda
    assert t.report(g.group_id, "r1", True).state == TransferState.PENDING
    assert t.report(g.group_id, "r2", True).state == TransferState.PENDING  # the sender has not confirmed
    assert t.report(g.group_id, "r1", True, identity=b"\x01" * 16).state == TransferState.PENDING
    assert g.identity == b"", "only the sender's report names what was sent"
    assert t.report(g.group_id, "t", True, identity=b"\x02" * 16).state == TransferState.COMMITTED
    assert finished == [g] and g.identity == b"\x02" * 16
    assert t.report(g.group_id, "r2", False, "late").state == TransferState.COMMITTED  # final


def test_one_failure_or_departure_aborts_for_everyone() -> None:
    t, finished, _ = transfers()
    g = t.allocate(7, T, [R1, R2], 0, "")
    t.report(g.group_id, "r1", True)
    assert t.report(g.group_id, "r2", False, "bucket 3 corrupt").state == TransferState.ABORTED
    assert "r2 failed: bucket 3 corrupt" in g.error
    g2 = t.allocate(7, T, [R1, R2], 0, "")
    assert g2.port != g.port or g2.group_id != g.group_id
    assert t.member_left("r1", "lease expired") == [g2] and "r1 left: lease expired" in g2.error
    with pytest.raises(FailedPrecondition, match="not a member"):
        t.report(g2.group_id, "stranger", True)
    assert [x.state for x in finished] == [TransferState.ABORTED, TransferState.ABORTED]


def test_deadline_new_group_and_ports() -> None:
    t, finished, clock = transfers(range(30000, 30002))
    g1 = t.allocate(1, T, [R1], 5, "")
    g2 = t.allocate(1, T, [R2], 5, "nccl")  # supersedes g1: the trainer is in both
    assert g1.state == TransferState.ABORTED and "superseded" in g1.error and g2.backend == "nccl"
    g3 = t.allocate(2, Component(Identity(Role.TRAINER, "t2")), [Component(Identity(Role.ROLLOUT, "r3"))], 5, "")
    assert {g2.port, g3.port} == {30000, 30001}
    with pytest.raises(ResourceExhausted):
        t.allocate(3, Component(Identity(Role.TRAINER, "t3")), [Component(Identity(Role.ROLLOUT, "r4"))], 5, "")
    clock.now = 6
    assert {g.group_id for g in t.sweep()} == {g2.group_id, g3.group_id} and "deadline passed" in g2.error
    with pytest.raises(InvalidArgument):
        t.allocate(4, T, [R1], 5, "mpi")
    with pytest.raises(FailedPrecondition, match="at least one"):
        t.allocate(4, T, [], 5, "")


async def test_wait_returns_when_the_outcome_is_known() -> None:
    t, _, _ = transfers()
    g = t.allocate(1, T, [R1], 0, "")
    waiter = asyncio.ensure_future(t.wait(g.group_id, 5))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    t.report(g.group_id, "r1", True)
    t.report(g.group_id, "t", True)
    assert (await asyncio.wait_for(waiter, 1)).state == TransferState.COMMITTED
    assert (await t.wait(g.group_id, 0)).state == TransferState.COMMITTED


async def test_an_outcome_decided_while_the_waiter_is_being_scheduled_is_not_missed() -> None:
    """The waiter checked PENDING and asked for the next change; the commit comes before its wait
    has run a step (reports handled back to back). Asking must already listen: a wait that began
    listening only when its task first ran slept to its timeout (300 s in a run: a replica's swap
    of a committed version held until the group's deadline)."""
    t, _, _ = transfers()
    g = t.allocate(1, T, [R1], 0, "")
    waiter = asyncio.ensure_future(t.wait(g.group_id, 5))
    await asyncio.sleep(0)  # the waiter runs to its wait, nothing further
    t.report(g.group_id, "r1", True)
    t.report(g.group_id, "t", True)
    assert (await asyncio.wait_for(waiter, 1)).state == TransferState.COMMITTED


async def test_slow_watcher_is_dropped_without_blocking_others() -> None:
    bus = EventBus(queue_size=8)
    slow, fast, only_r1 = bus.subscribe(), bus.subscribe(), bus.subscribe(["r1"])
    got: list[int] = []
    for i in range(20):
        bus.publish(EventKind.STATE_CHANGED, R1 if i % 2 else R2)
        got.append((await asyncio.wait_for(fast.get(), 1)).sequence)
    assert got == list(range(1, 21))  # the fast watcher saw everything, in order
    with pytest.raises(ResourceExhausted, match="watch again"):
        await slow.get()
    with pytest.raises(ResourceExhausted):
        await only_r1.get()  # 10 events about r1 overflowed its 8 slots too
    assert bus.subscriber_count == 1


async def test_closing_the_bus_ends_each_watcher_after_what_was_queued_for_it() -> None:
    bus = EventBus()
    queued, waiting = bus.subscribe(), bus.subscribe(["r9"])
    bus.publish(EventKind.STATE_CHANGED, R1)  # queued for the first only (the other watches r9)
    pending = asyncio.ensure_future(waiting.get())
    await asyncio.sleep(0)
    assert not pending.done()
    bus.close()
    assert await asyncio.wait_for(pending, 1) is None
    assert (await asyncio.wait_for(queued.get(), 1)).component.id == "r1"
    assert await asyncio.wait_for(queued.get(), 1) is None
    assert await asyncio.wait_for(bus.subscribe().get(), 1) is None  # a watcher that comes while it stops


async def test_a_stopping_synchronizer_ends_its_watch_streams_instead_of_waiting_out_its_grace() -> None:
    """A Watch never ends by itself: the server's shutdown waited for it through its whole grace period
    (10 s by default, each time a synchronizer stopped with a trainer or replica watching it)."""
    from flywheel.synchronizer.client import SynchronizerClient
    from services.synchronizer.embedded import embedded_synchronizer

    events: list[object] = []
    synchronizer = embedded_synchronizer(server={"shutdown_grace_seconds": 300.0})
    sync = await synchronizer.__aenter__()
    async with SynchronizerClient(sync.address) as client:
        async def watch() -> None:
            async for event in client.watch([], send_initial=True):
                events.append(event)

        watcher = asyncio.ensure_future(watch())
        await client.register("rollout", "r1", address="127.0.0.1:1")
        while not events:
            await asyncio.sleep(0.01)
        # Stopped within the test's bound, not the grace: the stream ended cleanly (no error), so the
        # watcher returned where it would have watched again.
        await asyncio.wait_for(synchronizer.__aexit__(None, None, None), 60)
        await asyncio.wait_for(watcher, 60)


def test_event_filters() -> None:
    bus = EventBus()
    sub = bus.subscribe(["r2"])
    bus.publish(EventKind.STATE_CHANGED, R1)
    bus.publish(EventKind.VERSION_COMMITTED, version=3)
    assert [e.kind for e in sub._queue] == [EventKind.VERSION_COMMITTED]
    snapshot = bus.snapshot_events([R1, R2], frozenset({"r2"}))
    assert [e.component.id for e in snapshot] == ["r2"]


def test_auto_picks_ipc_for_one_gpu_nccl_for_several_and_gloo_off_cuda() -> None:
    def on(component: str, role: Role, gpu: str) -> Component:
        labels = {"device": "cuda:0", "gpu": gpu} if gpu else {"device": "cpu"}
        return Component(Identity(role, component, "10.1.2.3:50052", labels=labels))

    t, _, _ = transfers(range(30000, 30010))
    trainer = on("t", Role.TRAINER, "GPU-a")
    assert t.allocate(1, trainer, [on("r1", Role.ROLLOUT, "GPU-a")], 5, "").backend == "ipc"  # co-located
    assert t.allocate(1, trainer, [on("r1", Role.ROLLOUT, "GPU-a"), on("r2", Role.ROLLOUT, "GPU-b")], 5, "").backend == "nccl"
    assert t.allocate(1, trainer, [on("r1", Role.ROLLOUT, "")], 5, "").backend == "gloo"
    unlabelled = Component(Identity(Role.ROLLOUT, "r3", labels={"device": "cuda:0"}))  # no gpu label: not known to share
    assert t.allocate(1, trainer, [unlabelled], 5, "").backend == "nccl"
    assert t.allocate(1, trainer, [on("r1", Role.ROLLOUT, "")], 5, "ipc").backend == "ipc"  # asked for explicitly
