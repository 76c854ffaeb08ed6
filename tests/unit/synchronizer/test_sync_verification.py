"""Measured verification at the synchronizer: what it records with each version (tensor digests,
the trainer's probe) by every method, GetVersion, and the judge: VERIFIED only with every tensor
measured and the recorded identity resident; claims of versions it never recorded refused; a
quarantine that holds across registrations and restarts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from flywheel.codec import identify
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from flywheel.probe import ProbeBatch, ProbeCheck, ProbeStatistic
from flywheel.synchronizer.convert import update_from_pb, update_report_from_pb, update_to_pb
from flywheel.synchronizer.types import (
    EventKind, Identity, Method, Role, TransferState, UpdateCoverage, UpdateOutcome, UpdatePhase, UpdateRecord,
)
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import manifest_frame
from services.synchronizer.checkpoints import MANIFEST_FILE
from services.synchronizer.core import Synchronizer
from services.synchronizer.servicer import event_to_pb
from services.synchronizer.store import Store
from tests.unit.synchronizer.sync_helpers import frames_of, measured_all, small_state, verified_report
from tests.unit.synchronizer.test_sync_core import push, service
from tests.unit.synchronizer.test_sync_store_checkpoints import write_checkpoint

#: A trainer's probe: 2 sequences of 4 tokens, 6 log-probs.
PROBE = ProbeBatch.of([[3, 1, 4, 1], [5, 9, 2, 6]], [[-1.5, -0.25, -3.0], [-0.5, -2.0, -1.0]])
TENSORS = len(small_state())
R = Identity(Role.ROLLOUT, "r", capabilities=frozenset({Method.MEMORY, Method.NCCL}))


def push_probed(plane, version: int, seed: int = 0, probe: ProbeBatch | None = PROBE, state=None) -> None:
    """A MEMORY push (of small_state(seed), or `state`) whose manifest carries `probe`, as the trainer's does."""
    manifest, _, chunks = frames_of(state if state is not None else small_state(seed), version)
    if probe is not None:
        manifest.probe.CopyFrom(probe.to_pb())
    buffer = plane.begin_push(manifest, manifest_frame(manifest))
    for chunk in chunks:
        plane.add_chunk(buffer, *chunk)
    plane.commit_push(buffer)


def checkpoint_dir(tmp_path: Path, version: int, probe: ProbeBatch | None = None) -> tuple[Path, dict[str, bytes]]:
    """A checkpoint directory with its weight manifest (and `probe` in it); its tensor digests."""
    from flywheel.common.v1 import common_pb2

    path = tmp_path / f"v{version}"
    write_checkpoint(path, version)
    manifest = common_pb2.WeightManifest.FromString((path / MANIFEST_FILE).read_bytes())
    if probe is not None:
        manifest.probe.CopyFrom(probe.to_pb())
        (path / MANIFEST_FILE).write_bytes(manifest.SerializeToString())
    return path, {t.name: bytes(t.digest) for t in manifest.tensors}


def nccl_version(sync, plane, version: int, seed: int, **sent) -> object:
    """A committed NCCL transfer of `version` whose rank 0 reports small_state(seed)'s identity and `sent`."""
    for identity in (Identity(Role.TRAINER, "t", "127.0.0.1:1"), R):
        if identity.id not in sync.registry.components:
            sync.register(identity, 0, 0)
    group = plane.allocate_group(version, "t", ["r"], 0, "gloo")
    plane.report_transfer(group.group_id, "r", True, "")
    plane.report_transfer(group.group_id, "t", True, "", identify(small_state(seed)).digest, **sent)
    return group


async def test_every_method_records_the_digests_and_probe_that_get_version_serves(tmp_path: Path) -> None:
    sync, plane, _ = service(tmp_path, checkpoint_root=str(tmp_path))
    push_probed(plane, 1, seed=1)
    path, digests = checkpoint_dir(tmp_path, 2, probe=PROBE)
    await plane.register_checkpoint(2, str(path), "t", digests)  # the probe comes from the directory's manifest
    group = nccl_version(sync, plane, 3, seed=3, tensors=dict(identify(small_state(3)).tensors), probe=PROBE)
    assert group.state == TransferState.COMMITTED

    memory = await plane.get_version(1)
    assert memory.identity == identify(small_state(1)) and memory.probe == PROBE and memory.epoch == 0
    checkpoint = await plane.get_version(2)
    assert checkpoint.identity.tensors == digests and checkpoint.identity.digest == sync.identity_of(2)
    assert checkpoint.probe == PROBE
    nccl = await plane.get_version(3)
    assert nccl.identity == identify(small_state(3)) and nccl.probe == PROBE
    # What the servicer sends, and what a client makes of it.
    assert type(memory).from_pb(memory.to_pb()) == memory

    # Persisted with the version: a restarted synchronizer serves the same.
    again = Synchronizer(sync.config)
    assert [(r.tensors, r.probe) for r in again.catalog.ordered()] == [
        (dict(identify(small_state(1)).tensors), PROBE), (digests, PROBE), (dict(identify(small_state(3)).tensors), PROBE)]

    with pytest.raises(NotFound, match="version 4 has not been committed in lineage 0"):
        await plane.get_version(4)
    with pytest.raises(InvalidArgument, match="version 0 is the base model"):
        await plane.get_version(0)
    sync.rewind(2)
    with pytest.raises(NotFound, match="version 3 was dropped by a rewind"):
        await plane.get_version(3)


async def test_a_delta_carries_its_target_versions_probe() -> None:
    sync, plane, _ = service()
    first = small_state(1)
    second = {**first, "layer.0.bias": first["layer.0.bias"] + 1}  # one tensor changed: a delta is worth it
    later = ProbeBatch.of([[1, 2]], [[-0.75]])
    push_probed(plane, 1, state=first)
    push_probed(plane, 2, state=second, probe=later)
    buffer = await plane.open_pull(2, base_version=1, base_identity=identify(first).digest)
    assert buffer.manifest.base_version == 1 and ProbeBatch.from_pb(buffer.manifest.probe) == later


async def test_a_version_published_without_digests_or_probe_is_served_as_such() -> None:
    sync, plane, _ = service()
    push_probed(plane, 1, probe=None)
    proof = await plane.get_version(1)
    assert proof.probe is None and proof.identity.tensors  # the codec's manifest always carries digests
    nccl_version(sync, plane, 2, seed=2)  # an older trainer: the identity alone
    assert (await plane.get_version(2)).identity.tensors == {}


async def test_tensor_digests_that_do_not_compose_to_the_identity_are_refused(tmp_path: Path) -> None:
    sync, plane, _ = service(checkpoint_root=str(tmp_path))
    other = dict(identify(small_state(4)).tensors)
    with pytest.raises(InvalidArgument, match="tensor digests compose to .* not to the identity"):
        nccl_version(sync, plane, 1, seed=1, tensors=other)
    group = sync.transfers.pending_for("t")
    assert group is not None and "t" not in group.confirmed, "a refused report confirms nothing"
    with pytest.raises(InvalidArgument, match="only rank 0"):
        plane.report_transfer(group.group_id, "r", True, "", identify(small_state(1)).digest, other)

    # A checkpoint whose registration sends other digests than its directory's manifest holds.
    path, digests = checkpoint_dir(tmp_path, 2)
    wrong = {**digests, next(iter(digests)): b"\x00" * 16}
    with pytest.raises(DataLoss, match="disagree on 1 tensor digest"):
        await plane.register_checkpoint(2, str(path), "t", wrong)
    bare = tmp_path / "bare"
    write_checkpoint(bare, 2, manifest=False)
    with pytest.raises(InvalidArgument, match="no weight_manifest.pb with the identity"):
        await plane.register_checkpoint(2, str(bare), "t", digests)
    assert sync.catalog.latest == 0

    # A pushed manifest whose tensor digest is another version's.
    manifest, _, _ = frames_of(small_state(5), 2)
    manifest.tensors[0].digest = other[manifest.tensors[0].name]
    with pytest.raises(InvalidArgument, match="manifest.tensors: the 5 tensor digests compose to .* not to the"):
        plane.begin_push(manifest, manifest_frame(manifest))
    assert not sync.weights.staging


def test_a_quarantine_holds_across_registering_again_and_a_restart(tmp_path: Path) -> None:
    sync, plane, _ = service(tmp_path)
    sync.register(R, 0, 0)
    push_probed(plane, 1, seed=1)
    sync.report_update(UpdateRecord("r", 1, UpdateOutcome.FAILED, failed_phase=UpdatePhase.APPLY, reason="boom"))
    why = sync.registry.get("r").quarantine_reason
    assert sync.registry.get("r").quarantined and "apply of version 1 failed: boom" in why

    # Its heartbeat found it forgotten, or its process restarted: it registers again, with the right identity even.
    again = sync.register(R, 1, 1, sync.identity_of(1))
    assert again.quarantined and again.quarantine_reason == why
    sync.deregister("r")
    assert sync.register(R, 0, 0).quarantined

    sync.store.close()
    restarted = Synchronizer(sync.config)
    assert restarted.registry.get("r").quarantined
    assert restarted.register(R, 1, 1, restarted.identity_of(1)).quarantine_reason == why
    assert REGISTRY.get_sample_value("flywheel_synchronizer_quarantined_rollouts") == 1
    assert restarted.report_update(verified_report(restarted, "r", 1)).verified
    assert not restarted.registry.get("r").quarantined, "a verified update ends it"
    assert REGISTRY.get_sample_value("flywheel_synchronizer_quarantined_rollouts") == 0
    assert not Store(sync.config.store_path).load_components()[0].quarantined


def test_a_claim_for_a_version_never_recorded_is_refused_and_a_failure_still_counts() -> None:
    sync, plane, _ = service()
    sync.register(R, 0, 0)
    push_probed(plane, 1, seed=1)
    for outcome in (UpdateOutcome.VERIFIED, UpdateOutcome.UNVERIFIED):
        with pytest.raises(FailedPrecondition, match="reports version 7 .* version 7 has not been committed"):
            sync.report_update(UpdateRecord("r", 7, outcome, resident_identity=b"\x07" * 16,
                                            coverage=measured_all(TENSORS)))
    assert not sync.updates.records() and not sync.registry.get("r").quarantined
    # A failure needs nothing to judge against: the replica's weights may be broken either way.
    failed = sync.report_update(UpdateRecord("r", 7, UpdateOutcome.FAILED, failed_phase=UpdatePhase.TRANSFER,
                                             reason="push aborted"))
    assert failed.outcome == UpdateOutcome.FAILED and sync.registry.get("r").quarantined


def test_a_verified_claim_without_full_coverage_is_recorded_unverified_and_quarantines() -> None:
    sync, plane, _ = service()
    sync.register(R, 0, 0)
    push_probed(plane, 1, seed=1)
    watcher = sync.events.subscribe([])
    identity = sync.identity_of(1)

    partial = UpdateCoverage(tensors=TENSORS, bytes=100, resident_tensors=3, resident_bytes=60)
    record = sync.report_update(UpdateRecord("r", 1, UpdateOutcome.VERIFIED, resident_identity=identity,
                                             coverage=partial))
    assert record.outcome == UpdateOutcome.UNVERIFIED and record.coverage == partial
    assert f"3 of {TENSORS} tensors measured" in record.reason
    c = sync.registry.get("r")
    assert c.quarantined and c.quarantine_reason.startswith("version 1 is unverified: claimed verified, but")
    event = watcher._queue[-1]
    assert event.kind == EventKind.UPDATE_REPORTED and update_from_pb(event_to_pb(event).update) == record

    def claim(coverage: UpdateCoverage, resident: bytes = identity) -> UpdateRecord:
        return sync.report_update(UpdateRecord("r", 1, UpdateOutcome.VERIFIED, resident_identity=resident,
                                               coverage=coverage))

    # Complete by its own count, but it counted fewer tensors than the version has.
    assert "counted 2 tensors; version 1 has 5" in claim(measured_all(2)).reason
    # RECEIVED tensors rest on the probe: it must have passed, over the recorded probe's tokens.
    passed = ProbeCheck(ran=True, tokens=PROBE.tokens, max_abs_diff=1e-4, mean_abs_diff=1e-5, tolerance=1e-3,
                        passed=True)
    received = UpdateCoverage(TENSORS, 100, 2, 40, TENSORS - 2, 60, passed)
    failed_probe = UpdateCoverage(TENSORS, 100, 2, 40, TENSORS - 2, 60,
                                  ProbeCheck(True, PROBE.tokens, 0.5, 0.1, 1e-3, False))
    assert claim(failed_probe).outcome == UpdateOutcome.UNVERIFIED
    short_probe = UpdateCoverage(TENSORS, 100, 2, 40, TENSORS - 2, 60, ProbeCheck(True, 3, 0.0, 0.0, 1e-3, True))
    assert "its probe compared 3 tokens; version 1's probe has 6" in claim(short_probe).reason
    assert claim(measured_all(TENSORS), resident=b"").outcome == UpdateOutcome.UNVERIFIED
    # Another identity resident is a failed verification, however little was measured.
    wrong = claim(partial, resident=b"\x01" * 16)
    assert wrong.outcome == UpdateOutcome.FAILED and wrong.failed_phase == UpdatePhase.VERIFY
    assert sync.registry.get("r").quarantined

    assert claim(received).verified and not sync.registry.get("r").quarantined
    assert claim(measured_all(TENSORS)).verified
    # A replica that says itself it could not measure everything stays unverified.
    own = sync.report_update(UpdateRecord("r", 1, UpdateOutcome.UNVERIFIED, coverage=partial, reason="vLLM on TP=2"))
    assert own.outcome == UpdateOutcome.UNVERIFIED and own.reason == "vLLM on TP=2"
    assert sync.registry.get("r").quarantined

    # A version its publisher sent no identity for can be verified by nobody.
    nccl_version(sync, plane, 2, seed=2)
    sync.catalog.records[2].identity = b""
    assert "committed without an identity" in claim_of(sync, 2).reason


def claim_of(sync, version: int) -> UpdateRecord:
    return sync.report_update(UpdateRecord("r", version, UpdateOutcome.VERIFIED, resident_identity=b"\x02" * 16,
                                           coverage=measured_all(TENSORS)))


def test_coverage_travels_and_bad_numbers_are_refused() -> None:
    coverage = UpdateCoverage(TENSORS, 100, 2, 40, 3, 60, ProbeCheck(True, 6, 1e-4, 1e-5, 1e-3, True))
    record = UpdateRecord("r", 1, UpdateOutcome.UNVERIFIED, coverage=coverage, reason="r")
    assert update_from_pb(update_to_pb(record)) == record

    def report(**kw) -> pb.ReportUpdateRequest:
        return pb.ReportUpdateRequest(id="r", version=1, outcome=pb.UPDATE_OUTCOME_UNVERIFIED, **kw)

    assert update_report_from_pb(report(coverage=update_to_pb(record).coverage)).coverage == coverage
    with pytest.raises(InvalidArgument, match="exceed the version's 5 tensors"):
        update_report_from_pb(report(coverage=pb.UpdateCoverage(tensors=5, resident_tensors=4, received_tensors=2)))
    with pytest.raises(InvalidArgument, match="a pass needs a probe that ran"):
        update_report_from_pb(report(coverage=pb.UpdateCoverage(
            probe=pb.ProbeCheck(ran=True, tokens=6, max_abs_diff=0.5, tolerance=0.01, passed=True))))
    with pytest.raises(InvalidArgument, match="outcome: must be VERIFIED, UNVERIFIED or FAILED"):
        update_report_from_pb(pb.ReportUpdateRequest(id="r", version=1))


def test_a_median_check_travels_and_a_pass_must_hold_its_own_statistic() -> None:
    median = ProbeCheck(True, 60, 6.9, 0.3, 0.25, True, median_abs_diff=0.08, statistic=ProbeStatistic.MEDIAN)
    record = UpdateRecord("r", 1, UpdateOutcome.VERIFIED, coverage=UpdateCoverage(TENSORS, 100, 2, 40, 3, 60, median))
    assert update_from_pb(update_to_pb(record)) == record
    assert "median |diff| 0.08 nats (max 6.9" in median.describe()

    def probe(**kw) -> pb.ReportUpdateRequest:
        return pb.ReportUpdateRequest(id="r", version=1, outcome=pb.UPDATE_OUTCOME_UNVERIFIED,
                                      coverage=pb.UpdateCoverage(probe=pb.ProbeCheck(ran=True, tokens=60, **kw)))

    # An unset statistic is the largest difference: a pass on a median within bound but a max past it is refused.
    with pytest.raises(InvalidArgument, match="max \\|diff\\| 0.5 against tolerance 0.25"):
        update_report_from_pb(probe(max_abs_diff=0.5, median_abs_diff=0.1, tolerance=0.25, passed=True))
    with pytest.raises(InvalidArgument, match="median \\|diff\\| 0.3 against tolerance 0.25"):
        update_report_from_pb(probe(max_abs_diff=0.5, median_abs_diff=0.3, tolerance=0.25, passed=True,
                                    statistic=pb.PROBE_STATISTIC_MEDIAN))
    with pytest.raises(InvalidArgument, match="the median difference 0.6 exceeds the largest 0.5"):
        update_report_from_pb(probe(max_abs_diff=0.5, median_abs_diff=0.6, tolerance=1.0))
    with pytest.raises(InvalidArgument, match="a pass needs"):  # a NaN scored at one token is never a pass
        update_report_from_pb(probe(max_abs_diff=math.inf, median_abs_diff=0.1, tolerance=0.25, passed=True,
                                    statistic=pb.PROBE_STATISTIC_MEDIAN))
    with pytest.raises(InvalidArgument, match="unknown statistic 9"):
        update_report_from_pb(probe(max_abs_diff=0.5, statistic=9))
    held = update_report_from_pb(probe(max_abs_diff=0.5, median_abs_diff=0.1, tolerance=0.25, passed=True,
                                       statistic=pb.PROBE_STATISTIC_MEDIAN))
    assert held.coverage.probe.passed and held.coverage.probe.held == 0.1
