"""The domain service without gRPC: choreography, timeouts, transfers, restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flywheel.errors import FailedPrecondition, NotFound, Unavailable
from services.synchronizer.config import SynchronizerConfig
from services.synchronizer.core import Synchronizer
from services.synchronizer.plane import WeightPlane
from flywheel.synchronizer.types import EventKind, Identity, Method, Role, State, Style, TransferState
from tests.unit.synchronizer.sync_helpers import frames_of, small_state


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def service(tmp_path: Path | None = None, **kw) -> tuple[Synchronizer, WeightPlane, Clock]:
    clock = Clock()
    config = SynchronizerConfig(store_path=tmp_path / "sync.sqlite3" if tmp_path else None, lease_seconds=5, **kw)
    sync = Synchronizer(config, clock=clock)
    return sync, WeightPlane(sync), clock


def push(plane: WeightPlane, version: int, seed: int = 0) -> None:
    manifest, mframe, chunks = frames_of(small_state(seed), version)
    buffer = plane.begin_push(manifest, mframe)
    for c in chunks:
        plane.add_chunk(buffer, *c)
    plane.commit_push(buffer)


def test_dynamic_request_times_out_and_is_asked_again() -> None:
    sync, plane, clock = service()
    sync.configure_policy(style=Style.DYNAMIC_BY_EXPLORER, method=Method.MEMORY, interval=2, timeout_seconds=3)
    sync.register(Identity(Role.TRAINER, "t"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "r"), 0, 0)
    sub = sync.events.subscribe(["r"])
    assert not sync.need_sync("r", 1).decision.need_sync
    answer = sync.need_sync("r", 2)
    assert answer.decision.need_sync and answer.component.state == State.REQUIRE_SYNC and answer.request_deadline_unix_ms
    clock.now += 2
    sync.sweep()
    assert sync.registry.get("r").state == State.REQUIRE_SYNC
    for c in ("t", "r"):
        sync.heartbeat(c, 2, 0)
    clock.now += 2  # the trainer never synced: the request lapses
    sync.sweep()
    assert sync.registry.get("r").state == State.RUNNING
    kinds = [e.kind for e in list(sub._queue)]
    assert kinds[-2:] == [EventKind.SYNC_REQUESTED, EventKind.STATE_CHANGED] and "timed out" in sub._queue[-1].message
    assert sync.need_sync("r", 3).decision.need_sync  # asks again on its next step
    assert sync.need_sync("t", 5).decision.need_sync  # and the trainer sees it
    push(plane, 5)
    sync.set_state("r", State.RUNNING, weight_version=5)
    assert sync.registry.get("r").last_sync_step == 3
    assert not sync.need_sync("r", 4).decision.need_sync and sync.need_sync("r", 5).decision.need_sync


def test_push_rules_and_pull_errors() -> None:
    sync, plane, _ = service(keep_versions=1)
    push(plane, 2)
    with pytest.raises(FailedPrecondition, match="not newer than the newest committed version 2"):
        push(plane, 2)
    push(plane, 3)
    with pytest.raises(NotFound, match="oldest kept is 3"):
        asyncio.run(plane.open_pull(2))


def test_nccl_commit_abort_and_expiry_move_states() -> None:
    sync, plane, clock = service()
    sync.configure_policy(style=Style.FIXED, method=Method.NCCL, interval=1)
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    for r in ("a", "b"):
        sync.register(Identity(Role.ROLLOUT, r, capabilities=frozenset({Method.NCCL})), 0, 0)
    assert sync.need_sync("t", 1).component.state == State.WAITING_SYNC
    g = plane.allocate_group(1, "t", [], 0, "")
    assert [m for m, _ in g.members] == ["t", "a", "b"]
    for r in ("a", "b"):
        assert sync.need_sync(r, 1).group is g
        sync.set_state(r, State.WAITING_SYNC)
    plane.report_transfer(g.group_id, "a", True, "")
    plane.report_transfer(g.group_id, "b", False, "injected")
    assert g.state == TransferState.ABORTED
    assert [(c.state, c.weight_version) for c in map(sync.registry.get, "tab")] == [(State.RUNNING, 0)] * 3
    assert sync.catalog.latest == 0

    g2 = plane.allocate_group(1, "t", ["a", "b"], 0, "")
    plane.report_transfer(g2.group_id, "a", True, "")
    clock.now += 4
    sync.heartbeat("t", 1, 0)
    sync.heartbeat("a", 1, 0)
    clock.now += 2  # b went silent mid-transfer: its lease ends, the transfer aborts
    sync.sweep()
    assert g2.state == TransferState.ABORTED and "b left: lease expired" in g2.error
    assert sync.registry.get("b").state == State.STOPPED

    g3 = plane.allocate_group(1, "t", [], 0, "")  # b is not in the rebuilt group
    assert [m for m, _ in g3.members] == ["t", "a"]
    plane.report_transfer(g3.group_id, "a", True, "")
    assert g3.state == TransferState.PENDING, "the sender has not confirmed (with what it sent) yet"
    watcher = sync.events.subscribe([])
    plane.report_transfer(g3.group_id, "t", True, "", b"\x07" * 16)
    # The transfer's outcome comes before the version's commit: a watcher that stops once it has heard
    # the newest version (the controller at a run's end) has heard the transfer finish too.
    finished = [(e.kind, e.latest_version) for e in watcher._queue
                if e.kind in (EventKind.TRANSFER_FINISHED, EventKind.VERSION_COMMITTED)]
    assert finished == [(EventKind.TRANSFER_FINISHED, 0), (EventKind.VERSION_COMMITTED, 1)]
    assert g3.state == TransferState.COMMITTED and sync.registry.get("a").weight_version == 1
    assert sync.catalog.latest == 1 and sync.catalog.get(1).method == Method.NCCL
    assert sync.catalog.get(1).identity == b"\x07" * 16, "the version is committed with the sender's identity"


def test_a_rollout_that_joins_behind_an_nccl_version_gets_it_broadcast_again() -> None:
    """NCCL keeps no copy to pull: a late replica awaits the newest version at registration, the trainer
    (still holding it) is told to broadcast it again, to the late replica only."""
    sync, plane, _ = service()
    sync.configure_policy(style=Style.FIXED, method=Method.NCCL, interval=2)
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "a", capabilities=frozenset({Method.NCCL})), 0, 0)
    assert sync.need_sync("t", 2).decision.need_sync
    first = plane.allocate_group(2, "t", [], 0, "")
    for member, _ in first.members:
        plane.report_transfer(first.group_id, member, True, "")
    assert sync.catalog.latest == 2 and not sync.need_sync("t", 2).decision.need_sync

    sub = sync.events.subscribe([])
    late = sync.register(Identity(Role.ROLLOUT, "late", capabilities=frozenset({Method.NCCL})), 0, 0)
    assert (late.state, late.awaited_version) == (State.REQUIRE_SYNC, 2)
    assert [e.kind for e in sub._queue][-1] == EventKind.SYNC_REQUESTED  # what wakes the trainer's publisher
    answer = sync.need_sync("t", 2)
    assert answer.decision.need_sync and answer.decision.version == 2
    group = plane.allocate_group(2, "t", [], 0, "")
    assert [m for m, _ in group.members] == ["t", "late"], "the replica already on version 2 is left alone"
    sync.set_state("late", State.WAITING_SYNC)  # as the replica does when it joins
    plane.report_transfer(group.group_id, "late", True, "")
    plane.report_transfer(group.group_id, "t", True, "")
    assert (sync.registry.get("late").state, sync.registry.get("late").weight_version) == (State.RUNNING, 2)
    assert sync.catalog.latest == 2 and not sync.need_sync("t", 2).decision.need_sync

    # A trainer that has moved past the version cannot send it: the late one waits for the next broadcast.
    sync.register(Identity(Role.ROLLOUT, "later", capabilities=frozenset({Method.NCCL})), 0, 0)
    assert not sync.need_sync("t", 3).decision.need_sync
    assert sync.need_sync("t", 4).decision.need_sync
    assert [m for m, _ in plane.allocate_group(4, "t", [], 0, "").members] == ["t", "a", "late", "later"]

    # MEMORY versions are pulled by the replica itself: registering behind one asks nothing of anyone.
    memory, mplane, _ = service()
    memory.configure_policy(style=Style.FIXED, method=Method.MEMORY, interval=1)
    memory.register(Identity(Role.TRAINER, "t"), 1, 0)
    push(mplane, 1)
    assert memory.register(Identity(Role.ROLLOUT, "r"), 0, 0).state == State.RUNNING


def test_restart_restores_state_and_asks_for_lost_bytes(tmp_path: Path) -> None:
    sync, plane, _ = service(tmp_path)
    sync.configure_policy(style=Style.FIXED, method=Method.MEMORY, interval=10, offset=5)
    sync.register(Identity(Role.TRAINER, "t", capabilities=frozenset({Method.MEMORY})), 10, 0)
    sync.register(Identity(Role.ROLLOUT, "r"), 15, 0)
    push(plane, 10)
    sync.need_sync("r", 15)
    sync.store.close()

    again, plane2, _ = service(tmp_path)
    assert again.policy.offset == 5 and again.catalog.latest == 10
    assert again.registry.get("r").state == State.REQUIRE_SYNC and again.registry.get("r").awaited_version == 10
    assert again.push_requested
    with pytest.raises(Unavailable, match="asked to push it again"):
        asyncio.run(plane2.open_pull(0))
    answer = again.need_sync("t", 12)
    assert answer.push_requested and answer.decision.need_sync
    push(plane2, 10)  # the same version is accepted to restore the bytes
    assert not again.push_requested and asyncio.run(plane2.open_pull(0)).version == 10
