"""The fleet-update ledger: every replica's result of every weight update of
the last `keep_versions` versions, and the synchronizer's verdict on each.

A replica reports each update it makes (ReportUpdate): the phase durations,
the identity it measured on its resident weights, what it measured and how
(its coverage), its own verdict. The verdict kept here is the synchronizer's,
judged only against what it recorded with the version (`versions.VersionRecord`):
  * VERIFIED only when the replica measured every tensor of the version
    (`UpdateCoverage.complete`: RESIDENT, or RECEIVED with a passing probe) and
    the resident identity it measured equals the recorded one;
  * a resident identity other than the recorded one is a FAILED verification,
    whatever the coverage;
  * a success claimed with less than full coverage, without a measured
    identity, or of a version committed without an identity, is UNVERIFIED
    (not proof; it quarantines the replica like a failure);
  * a version a rewind dropped is a FAILED verification (`judge_dropped`);
  * version 0 after a start-over is the base model, which no publisher ever
    recorded an identity of: UNVERIFIED (`judge_base`), never VERIFIED.
A claim for a version never recorded in this lineage is refused by the
caller (`Synchronizer.report_update`). The controller reads the ledger
(Watch's UPDATE_REPORTED, ListUpdates) to decide the fleet's verdict for a
version: every live replica verified, or quarantined with a reason.

The ledger is memory only: a restarted synchronizer starts an empty one (the
replicas' quarantine flags are persisted with the components).
"""

from __future__ import annotations

import time
from dataclasses import replace

from flywheel.synchronizer.types import UpdateOutcome, UpdatePhase, UpdateRecord
from services.synchronizer.versions import VersionRecord


def _stamped(report: UpdateRecord, expected: bytes, epoch: int) -> UpdateRecord:
    return replace(report, expected_identity=expected, epoch=epoch, unix_ms=int(time.time() * 1000))


def _why_not_proof(report: UpdateRecord, version: VersionRecord) -> str:
    """Why a success claim does not prove `version` resident ("": it does)."""
    v, coverage = report.version, report.coverage
    if not version.identity:
        return (f"version {v} was committed without an identity (its publisher sent none): there is nothing to "
                "judge the resident weights against")
    if not coverage.complete:
        return f"not every tensor was measured: {coverage.describe()}"
    if version.tensors and coverage.tensors != len(version.tensors):
        return f"the replica counted {coverage.tensors} tensors; version {v} has {len(version.tensors)}"
    if coverage.received_tensors:  # complete through RECEIVED: the probe is what vouches for those tensors
        if version.probe is None:
            return f"its coverage rests on a probe, and version {v} was committed without one"
        if coverage.probe.tokens != version.probe.tokens:
            return (f"its probe compared {coverage.probe.tokens} tokens; version {v}'s probe has "
                    f"{version.probe.tokens}")
    if not report.resident_identity:
        return "the replica reported no resident identity it measured"
    return ""


def judge(report: UpdateRecord, version: VersionRecord | None, epoch: int) -> UpdateRecord:
    """The report with the synchronizer's verdict (see the module docstring), the version's recorded
    identity and the time filled in. `version` None (never recorded) is only for a FAILED report."""
    expected = version.identity if version is not None else b""
    record = _stamped(report, expected, epoch)
    if record.outcome == UpdateOutcome.FAILED:
        return record
    if version is None:
        raise ValueError(f"a {record.outcome.name} claim of version {record.version} needs the version's record")
    measured = record.resident_identity
    if measured and expected and measured != expected:
        return replace(
            record, outcome=UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY,
            reason=f"the resident weights' identity {measured.hex()[:16]} is not version {record.version}'s "
                   f"{expected.hex()[:16]}",
        )
    if record.outcome == UpdateOutcome.UNVERIFIED:
        return record  # the replica's own account of what it could not measure
    gap = _why_not_proof(record, version)
    if gap:
        return replace(record, outcome=UpdateOutcome.UNVERIFIED, reason=f"claimed verified, but {gap}")
    return record


def judge_dropped(report: UpdateRecord, rewound_to: int, epoch: int) -> UpdateRecord:
    """A report of a version a rewind dropped (one that has not been committed again since): whatever
    the replica measured, it holds a lost lineage's weights, never verified in this one."""
    return replace(
        _stamped(report, b"", epoch), outcome=UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY,
        reason=f"version {report.version} was dropped by a rewind (the last went back to version {rewound_to}, "
               f"lineage {epoch}): these weights are a lost lineage's",
    )


def judge_base(report: UpdateRecord, epoch: int) -> UpdateRecord:
    """A report of version 0 after the run started over (a rewind to 0). The base model is what each
    replica loaded from its own model path; no publisher computed its identity or a probe of it, so
    nothing the replica measured can be judged against a record, and echoing its own measurement back
    would prove nothing. A success claim is recorded UNVERIFIED: the base model is trusted exactly as
    at the run's start (the caller neither quarantines nor releases the replica for it)."""
    record = _stamped(report, b"", epoch)
    if record.outcome == UpdateOutcome.FAILED:
        return record
    return replace(record, outcome=UpdateOutcome.UNVERIFIED,
                   reason="version 0 is the base model, which no publisher recorded an identity of: trusted as at "
                          "the run's start, not verified")


class UpdateLedger:
    def __init__(self, keep_versions: int) -> None:
        self.keep_versions = keep_versions
        #: version -> component id -> its latest result for that version.
        self.by_version: dict[int, dict[str, UpdateRecord]] = {}

    def record(self, record: UpdateRecord) -> None:
        self.by_version.setdefault(record.version, {})[record.component_id] = record
        for old in sorted(self.by_version)[: -self.keep_versions]:
            del self.by_version[old]

    def drop_above(self, version: int) -> None:
        """A rewind: results for the abandoned versions are no one's any more."""
        for v in [v for v in self.by_version if v > version]:
            del self.by_version[v]

    def records(self, version: int = 0) -> list[UpdateRecord]:
        """Results of `version` (0: every version kept), oldest version first, then by component id."""
        versions = [version] if version else sorted(self.by_version)
        return [r for v in versions for _, r in sorted(self.by_version.get(v, {}).items())]
