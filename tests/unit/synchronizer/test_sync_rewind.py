"""Rewind: the one way down for versions. The catalog, the store and the bytes drop every
version above the rewound one, the lineage (epoch) goes up, the rollouts above it are sent
back and their first report at or below it is taken; bad requests say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound
from flywheel.runtime.auth import Scope
from flywheel.synchronizer.types import EventKind, Identity, Role, State, UpdateOutcome, UpdateRecord
from services.synchronizer.app import METHOD_SCOPES
from services.synchronizer.core import Synchronizer
from tests.unit.synchronizer.sync_helpers import measured_all, verified_report
from tests.unit.synchronizer.test_sync_core import push, service


def three_versions(tmp_path: Path | None = None):
    sync, plane, clock = service(tmp_path, keep_versions=3)
    sync.register(Identity(Role.TRAINER, "t"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "r"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "behind"), 0, 0)
    for version in (1, 2, 3):
        push(plane, version, seed=version)
    sync.heartbeat("r", 3, 3)
    sync.heartbeat("behind", 3, 1)
    return sync, plane, clock


async def test_rewind_drops_newer_versions_raises_the_epoch_and_sends_rollouts_back(tmp_path: Path) -> None:
    sync, plane, _ = three_versions(tmp_path)
    sub = sync.events.subscribe(["r"])
    rewound = sync.rewind(2, "trainer resumed at step 2")
    assert (rewound.epoch, rewound.latest_version, rewound.dropped, rewound.rewinding) == (1, 2, [3], ["r"])
    assert sync.catalog.latest == 2 and list(sync.weights.committed) == [1, 2]
    with pytest.raises(NotFound):
        await plane.open_pull(3)
    event = sub._queue[-1]
    assert (event.kind, event.version, event.epoch, event.rewound_to) == (EventKind.REWOUND, 2, 1, 2)
    assert event.latest_version == 2 and "step 2" in event.message
    # The rollout still serves 3: a stale beat changes nothing, its first report at or below 2 is taken.
    sync.heartbeat("r", 0, 3)
    assert sync.registry.get("r").weight_version == 3
    sync.heartbeat("r", 0, 2)
    assert sync.registry.get("r").weight_version == 2
    sync.heartbeat("r", 0, 1)  # the rewind is over for it: versions only go up again
    assert sync.registry.get("r").weight_version == 2
    # The new lineage goes on from 2: version 3 again, with other weights.
    push(plane, 3, seed=33)
    assert sync.catalog.latest == 3 and sync.epoch == 1
    # A restart (with the store) keeps the lineage, the dropped versions dropped, and the way back
    # open for a rollout that had not come back yet.
    sync.rewind(1)
    again = Synchronizer(sync.config)
    assert (again.epoch, again.rewound_to) == (2, 1)
    assert sorted(again.catalog.records) == [1]
    again.heartbeat("r", 0, 1)
    assert again.registry.get("r").weight_version == 1


def test_rewind_refuses_what_it_cannot_do_and_says_why() -> None:
    sync, _, _ = three_versions()
    with pytest.raises(InvalidArgument, match="to_version must be >= 1 .*set start_over"):
        sync.rewind(0)  # an unset to_version is not "drop everything"
    with pytest.raises(InvalidArgument, match=r"start_over goes back to version 0 \(the base model\); to_version must be 0, got 2"):
        sync.rewind(2, start_over=True)
    with pytest.raises(FailedPrecondition, match="nothing to rewind: the newest committed version is 3"):
        sync.rewind(3)
    with pytest.raises(FailedPrecondition, match="nothing to rewind"):
        sync.rewind(2**63)
    sync.heartbeat("t", 3, 3)  # a live trainer on version 3 would publish what a rewind to 2 drops
    with pytest.raises(FailedPrecondition, match="trainer 't' holds version 3, newer than 2"):
        sync.rewind(2)
    assert sync.catalog.latest == 3 and sync.epoch == 0  # a refusal changes nothing


async def test_starting_over_drops_every_version_and_takes_the_replicas_back_to_their_base_weights(tmp_path: Path) -> None:
    """The trainer died before its first checkpoint and came back on the base model: Rewind(0,
    start_over). Nothing of the lost lineage is kept; a replica's beat at version 0 is its way back,
    and the new lineage starts again at version 1."""
    sync, plane, _ = three_versions(tmp_path)
    sub = sync.events.subscribe(["r"])
    with pytest.raises(InvalidArgument, match="base model is reported only after a rewind to version 0"):
        sync.report_update(UpdateRecord("r", 0, UpdateOutcome.VERIFIED))
    sync.heartbeat("t", 3, 3)
    with pytest.raises(FailedPrecondition, match="trainer 't' holds version 3, newer than 0"):
        sync.rewind(0, start_over=True)
    sync.register(Identity(Role.TRAINER, "t"), 0, 0)  # restarted, on the base model
    rewound = sync.rewind(0, start_over=True)
    assert (rewound.epoch, rewound.latest_version, rewound.dropped) == (1, 0, [1, 2, 3])
    assert sorted(rewound.rewinding) == ["behind", "r"]
    assert not sync.catalog.records and not sync.weights.committed
    with pytest.raises(NotFound):
        await plane.open_pull(1)
    event = sub._queue[-1]
    assert (event.kind, event.version, event.epoch, event.rewound_to) == (EventKind.REWOUND, 0, 1, 0)
    assert "started over from the base model" in event.message
    sync.heartbeat("r", 0, 3)  # still on the lost lineage
    assert sync.registry.get("r").weight_version == 3
    # Reloaded its base weights: no publisher recorded the base model, so that is no proof (never VERIFIED),
    # and no quarantine either: as trusted as at the run's start.
    base = sync.report_update(UpdateRecord("r", 0, UpdateOutcome.VERIFIED, coverage=measured_all(5)))
    assert base.outcome == UpdateOutcome.UNVERIFIED and "base model" in base.reason
    assert not sync.registry.get("r").quarantined
    sync.heartbeat("r", 0, 0)
    assert sync.registry.get("r").weight_version == 0 and "r" in sync.registry.components
    assert sync.registry.rewinding == {"behind": 0}
    push(plane, 1, seed=11)
    assert sync.catalog.latest == 1 and sync.epoch == 1
    again = Synchronizer(sync.config)  # the store keeps the lineage and the way back still open
    assert (again.epoch, again.rewound_to, sorted(again.catalog.records)) == (1, 0, [1])
    again.heartbeat("behind", 0, 0)
    assert again.registry.get("behind").weight_version == 0


def test_a_beat_at_version_0_is_no_way_back_from_a_rewind_to_a_checkpoint() -> None:
    """0 on a beat means "not tracked" (an engine not loaded): only a start-over takes it."""
    sync, _, _ = three_versions()
    sync.rewind(2)
    sync.heartbeat("r", 0, 0)
    assert sync.registry.get("r").weight_version == 3 and sync.registry.rewinding == {"r": 2}


def test_rewind_aborts_pushes_above_it_and_cancels_sync_requests_for_dropped_versions() -> None:
    from tests.unit.synchronizer.sync_helpers import frames_of, small_state

    sync, plane, _ = three_versions()
    manifest, frame, _ = frames_of(small_state(4), 4)
    buffer = plane.begin_push(manifest, frame)
    c = sync.registry.get("behind")
    c.state, c.awaited_version, c.last_sync_step = State.REQUIRE_SYNC, 3, 3
    sync.rewind(2)
    assert buffer.phase.value == "aborted" and not sync.weights.staging
    assert c.state == State.RUNNING and c.awaited_version == 0 and c.last_sync_step == 2
    assert "behind" not in sync.registry.rewinding  # it serves 1: nothing to go back from


def test_a_broadcast_after_a_rewind_includes_the_rollouts_going_back() -> None:
    """NCCL versions are kept nowhere to pull from: the rewound version, broadcast again, goes to
    the rollouts above it as well as to those behind it. Its commit makes it the new lineage's,
    with the identity the trainer sent (the replicas' reports are judged against that); a later
    broadcast of it (a replica caught up) changes nothing."""
    sync, plane, _ = three_versions()
    sync.register(Identity(Role.ROLLOUT, "level"), 0, 2)
    sync.rewind(2)
    group = plane.allocate_group(2, "t", [], 0, "gloo")
    assert [m for m, _ in group.members] == ["t", "r", "behind"]  # "level" serves 2 already
    for member, _ in group.members:
        plane.report_transfer(group.group_id, member, True, "", identity=b"resumed" if member == "t" else b"")
    assert sync.registry.get("r").weight_version == 3  # until it reports 2, installed
    sync.heartbeat("r", 0, 2)
    assert sync.registry.get("r").weight_version == 2 and not sync.registry.rewinding
    assert sync.catalog.latest == 2 and sync.registry.get("behind").weight_version == 2
    record = sync.catalog.records[2]
    assert (record.identity, record.epoch) == (b"resumed", 1)
    assert sync.report_update(verified_report(sync, "r", 2, b"resumed")).verified

    sync.register(Identity(Role.ROLLOUT, "late"), 0, 0)
    again = plane.allocate_group(2, "t", [], 0, "gloo")
    for member, _ in again.members:
        plane.report_transfer(again.group_id, member, True, "", identity=b"other" if member == "t" else b"")
    assert sync.catalog.records[2].identity == b"resumed"


def test_a_report_of_a_dropped_version_after_the_rewind_is_no_verified_update() -> None:
    """A replica that finishes installing version 3 just after a rewind to 2 dropped it holds the
    lost lineage's weights: its report is judged failed (it is quarantined until an update of the
    new lineage verifies), not verified for want of an identity to compare. Once version 3 is
    committed again, a report of it is judged against the new identity as usual."""
    sync, plane, _ = three_versions()
    sync.rewind(2)
    record = sync.report_update(UpdateRecord("behind", 3, UpdateOutcome.VERIFIED, resident_identity=b"old-3"))
    assert record.outcome == UpdateOutcome.FAILED and record.epoch == 1
    assert "version 3 was dropped by a rewind (the last went back to version 2" in record.reason
    assert sync.registry.get("behind").quarantined
    assert sync.report_update(verified_report(sync, "behind", 2)).verified
    assert not sync.registry.get("behind").quarantined
    push(plane, 3, seed=33)
    assert sync.report_update(verified_report(sync, "behind", 3)).verified
    # A version the catalog never held (loaded by hand from a directory, say) has nothing to be judged
    # against: the claim is refused (test_sync_verification.py), never taken as verified.
    with pytest.raises(FailedPrecondition, match="version 9 has not been committed"):
        sync.report_update(UpdateRecord("behind", 9, UpdateOutcome.VERIFIED, resident_identity=b"9" * 16,
                                        coverage=measured_all(5)))


def test_a_restarted_synchronizer_still_knows_what_the_rewind_dropped(tmp_path: Path) -> None:
    sync, plane, _ = three_versions(tmp_path)
    sync.rewind(1)
    push(plane, 2, seed=22)  # the new lineage's version 2; 3 stays dropped
    again = Synchronizer(sync.config)
    assert again.catalog.dropped == {3}
    late = again.report_update(UpdateRecord("r", 3, UpdateOutcome.VERIFIED, resident_identity=b"old-3"))
    assert late.outcome == UpdateOutcome.FAILED and "dropped by a rewind" in late.reason
    assert again.report_update(verified_report(again, "r", 2)).verified


def test_a_rollout_registering_again_ends_its_rewind() -> None:
    sync, _, _ = three_versions()
    sync.rewind(1)
    assert sync.registry.rewinding == {"r": 1}  # "behind" serves 1 already
    sync.register(Identity(Role.ROLLOUT, "r"), 0, 0)
    assert "r" not in sync.registry.rewinding


def test_rewind_is_for_services_and_operators() -> None:
    # The controller calls it with the service token; an agent token is refused (test_scoped_tokens.py).
    assert METHOD_SCOPES["Rewind"] == Scope.SERVICE


def test_after_a_rewind_the_trainer_is_asked_to_publish_what_the_replicas_cannot_fetch() -> None:
    """MEMORY: the rewound version's bytes were evicted -> PUSH_REQUESTED, and the trainer's NeedSync says push."""
    sync, plane, _ = service(keep_versions=1)
    sync.register(Identity(Role.TRAINER, "t"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "r"), 0, 0)
    for version in (1, 2, 3):
        push(plane, version, seed=version)
    sync.heartbeat("r", 3, 3)
    sub = sync.events.subscribe([])
    sync.rewind(2)
    assert [e.kind for e in sub._queue][-1] == EventKind.PUSH_REQUESTED and sub._queue[-1].version == 2
    answer = sync.need_sync("t", 2)
    assert answer.decision.need_sync and answer.decision.version == 2 and answer.push_requested
    push(plane, 2, seed=2)  # accepted: it restores the rewound version's bytes
    assert 2 in sync.weights.committed and not sync.push_requested


def test_after_a_rewind_over_nccl_the_replicas_going_back_await_a_broadcast() -> None:
    from flywheel.synchronizer.types import Method, Style, TransferState

    sync, plane, _ = service()
    sync.configure_policy(style=Style.FIXED, method=Method.NCCL, interval=1)
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    sync.register(Identity(Role.ROLLOUT, "r", capabilities=frozenset({Method.NCCL})), 0, 0)
    for version in (1, 2):
        assert sync.need_sync("t", version).decision.need_sync
        group = plane.allocate_group(version, "t", [], 0, "gloo")
        sync.set_state("r", State.REQUIRE_SYNC)  # as a replica joining a broadcast does
        sync.set_state("r", State.WAITING_SYNC)
        for member, _ in group.members:
            plane.report_transfer(group.group_id, member, True, "")
        assert group.state == TransferState.COMMITTED
    assert sync.registry.get("r").weight_version == 2
    sync.heartbeat("t", 1, 1)  # the trainer resumed from its checkpoint of step 1
    sync.rewind(1)
    r = sync.registry.get("r")
    assert (r.state, r.awaited_version) == (State.REQUIRE_SYNC, 1)
    answer = sync.need_sync("t", 1)
    assert answer.decision.need_sync and answer.decision.version == 1, "broadcast version 1 again"
    group = plane.allocate_group(1, "t", [], 0, "gloo")
    assert [m for m, _ in group.members] == ["t", "r"]
