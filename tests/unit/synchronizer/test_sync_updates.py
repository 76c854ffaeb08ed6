"""Fleet updates at the synchronizer: identities recorded with versions, the
per-replica update ledger and its verdicts, quarantine, versions asked for
outside the schedule."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from flywheel.codec import identify
from flywheel.errors import InvalidArgument
from flywheel.synchronizer.types import (
    EventKind, Identity, Method, Role, State, Style, UpdateOutcome, UpdatePhase, UpdateRecord, UpdateTimings,
)
from services.synchronizer.store import Store
from tests.unit.synchronizer.sync_helpers import measured_all, small_state
from tests.unit.synchronizer.test_sync_core import push, service

R = Identity(Role.ROLLOUT, "r", capabilities=frozenset({Method.MEMORY}))


def identity_of(seed: int) -> bytes:
    return identify(small_state(seed)).digest


def verified(version: int, identity: bytes, component: str = "r") -> UpdateRecord:
    """A VERIFIED claim with every tensor of small_state measured as resident."""
    return UpdateRecord(component, version, UpdateOutcome.VERIFIED, resident_identity=identity,
                        timings=UpdateTimings(admit_seconds=0.01, transfer_seconds=0.2, apply_seconds=0.05,
                                              verify_seconds=0.02, reopen_seconds=0.001, pause_seconds=0.08),
                        served_version=version, coverage=measured_all(len(small_state())))


def test_a_pushed_version_is_committed_with_its_identity_and_lineage() -> None:
    sync, plane, _ = service()
    push(plane, 1, seed=1)
    record = sync.catalog.get(1)
    assert record.identity == identity_of(1) and record.epoch == 0
    assert plane.status().versions[0].record.identity == identity_of(1)


def test_the_synchronizer_judges_each_update_and_quarantines_a_failure_until_one_verifies() -> None:
    sync, plane, _ = service()
    sync.register(R, 0, 0)
    push(plane, 1, seed=1)
    watcher = sync.events.subscribe([])

    ok = sync.report_update(verified(1, identity_of(1)))
    assert ok.verified and ok.expected_identity == identity_of(1) and ok.unix_ms > 0
    c = sync.registry.get("r")
    assert not c.quarantined and c.weight_identity == identity_of(1)
    event = watcher._queue[-1]
    assert event.kind == EventKind.UPDATE_REPORTED and event.update == ok and event.component.id == "r"

    # A replica that claims success with other bytes resident (one element loaded wrong) is not believed.
    push(plane, 2, seed=2)
    claimed = sync.report_update(verified(2, identity_of(99)))
    assert claimed.outcome == UpdateOutcome.FAILED and claimed.failed_phase == UpdatePhase.VERIFY
    assert "not version 2's" in claimed.reason
    c = sync.registry.get("r")
    assert c.quarantined and "verify of version 2 failed" in c.quarantine_reason
    assert c.weight_identity == identity_of(99), "what it holds, as measured"

    # A failure it reports itself (an apply past its deadline) keeps it out too.
    push(plane, 3, seed=3)
    hung = sync.report_update(UpdateRecord("r", 3, UpdateOutcome.FAILED, failed_phase=UpdatePhase.APPLY,
                                           reason="apply did not finish within 2 s", served_version=2))
    assert not hung.verified and sync.registry.get("r").quarantined
    assert "apply of version 3 failed: apply did not finish within 2 s" in sync.registry.get("r").quarantine_reason

    # Only a verified update brings it back.
    push(plane, 4, seed=4)
    assert sync.report_update(verified(4, identity_of(4))).verified
    assert not sync.registry.get("r").quarantined and sync.registry.get("r").quarantine_reason == ""
    assert [(r.version, r.outcome) for r in sync.updates.records()] == [
        (1, UpdateOutcome.VERIFIED), (2, UpdateOutcome.FAILED), (3, UpdateOutcome.FAILED), (4, UpdateOutcome.VERIFIED)]
    assert [r.version for r in sync.updates.records(3)] == [3]


def test_the_ledger_keeps_the_last_versions_and_a_rewind_forgets_the_abandoned_ones() -> None:
    sync, plane, _ = service(keep_update_results=2)
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    sync.register(R, 0, 0)
    for v in (1, 2, 3):
        push(plane, v, seed=v)
        sync.report_update(verified(v, identity_of(v)))
    assert [r.version for r in sync.updates.records()] == [2, 3]
    sync.rewind(2)
    assert [r.version for r in sync.updates.records()] == [2]


def test_a_replica_holding_an_abandoned_version_is_never_current() -> None:
    """After a rewind the trainer publishes the same numbers with other bytes: a replica that
    registers with the old bytes of a number is quarantined, one with the run's bytes is not."""
    sync, plane, _ = service()
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    for v in (1, 2, 3):
        push(plane, v, seed=v)
    old_three = identity_of(3)
    sync.rewind(2)
    push(plane, 3, seed=33)  # the redone step 3: new bytes
    assert sync.catalog.get(3).identity == identity_of(33) != old_three and sync.catalog.get(3).epoch == 1

    stale = sync.register(Identity(Role.ROLLOUT, "stale"), 3, 3, old_three)
    assert stale.quarantined and "abandoned" in stale.quarantine_reason
    fresh = sync.register(Identity(Role.ROLLOUT, "fresh"), 3, 3, identity_of(33))
    assert not fresh.quarantined
    unknown = sync.register(Identity(Role.ROLLOUT, "base"), 0, 0)
    assert not unknown.quarantined


def test_a_version_asked_for_is_published_once_the_trainer_reaches_it() -> None:
    sync, plane, _ = service()
    sync.configure_policy(style=Style.FIXED, method=Method.MEMORY, interval=10)
    sync.register(Identity(Role.TRAINER, "t", "127.0.0.1:1"), 0, 0)
    with pytest.raises(InvalidArgument, match="min_version"):
        sync.request_version(0)
    watcher = sync.events.subscribe([])
    assert not sync.need_sync("t", 3).decision.need_sync  # FIXED(10): not due
    assert sync.request_version(5, "validation at version 5") == 0
    assert watcher._queue[-1].kind == EventKind.VERSION_REQUESTED and watcher._queue[-1].version == 5
    assert not sync.need_sync("t", 4).decision.need_sync  # the trainer has not got there yet
    answer = sync.need_sync("t", 5)
    assert answer.decision.need_sync and answer.decision.version == 5
    push(plane, 5, seed=5)
    assert sync.wanted_version == 0 and not sync.need_sync("t", 6).decision.need_sync
    assert sync.request_version(4) == 5, "already there: nothing to ask for"
    assert watcher._queue[-1].kind == EventKind.VERSION_COMMITTED


def test_identities_quarantine_and_the_pause_mode_survive_a_restart(tmp_path: Path) -> None:
    sync, plane, _ = service(tmp_path)
    sync.configure_policy(style=Style.FIXED, method=Method.MEMORY, interval=1, pause_mode="abort")
    sync.register(R, 0, 0)
    push(plane, 1, seed=1)
    sync.report_update(UpdateRecord("r", 1, UpdateOutcome.FAILED, failed_phase=UpdatePhase.TRANSFER, reason="cut"))
    sync.store.close()

    again, _, _ = service(tmp_path)
    assert again.catalog.get(1).identity == identity_of(1)
    assert again.registry.get("r").quarantined and "cut" in again.registry.get("r").quarantine_reason
    assert again.policy.pause_mode == "abort"
    assert again.configure_policy(interval=2).pause_mode == "abort", "unset keeps it"


def test_a_store_written_before_identities_opens_and_gains_them(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE components (id TEXT PRIMARY KEY, role INTEGER NOT NULL, address TEXT NOT NULL,
          capabilities TEXT NOT NULL, labels TEXT NOT NULL, state INTEGER NOT NULL, step INTEGER NOT NULL,
          weight_version INTEGER NOT NULL, last_heartbeat_ms INTEGER NOT NULL, last_sync_step INTEGER NOT NULL,
          awaited_version INTEGER NOT NULL);
        CREATE TABLE versions (version INTEGER PRIMARY KEY, method INTEGER NOT NULL, nbytes INTEGER NOT NULL,
          path TEXT NOT NULL, committed_unix_ms INTEGER NOT NULL);
        INSERT INTO components VALUES ('r', 2, '', '[]', '{}', 2, 4, 3, 0, 0, 0);
        INSERT INTO versions VALUES (3, 2, 100, '', 1);
    """)
    db.close()
    store = Store(path)
    [c] = store.load_components()
    [v] = store.load_versions()
    assert (c.weight_version, c.weight_identity, c.quarantined) == (3, b"", False)
    assert (v.version, v.identity, v.epoch, v.tensors, v.probe) == (3, b"", 0, {}, None)
    assert State(c.state) == State.RUNNING
