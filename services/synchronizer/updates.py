"""The fleet-update ledger: every replica's result of every weight update of
the last `keep_versions` versions, and the synchronizer's verdict on each.

A replica reports each update it makes (ReportUpdate): the phase durations,
the identity it measured on its resident weights, its own verdict. The
verdict kept here is the synchronizer's: an update is VERIFIED only when the
resident identity equals the identity the version was committed with; a
claim of success with other bytes is recorded as a FAILED verification. The
controller reads the ledger (Watch's UPDATE_REPORTED, ListUpdates) to decide
the fleet's verdict for a version: every live replica verified, or
quarantined with a reason.

The ledger is memory only: a restarted synchronizer starts an empty one (the
replicas' quarantine flags are persisted with the components).
"""

from __future__ import annotations

import time
from dataclasses import replace

from flywheel.synchronizer.types import UpdateOutcome, UpdatePhase, UpdateRecord


def judge(report: UpdateRecord, expected: bytes, epoch: int) -> UpdateRecord:
    """The report with the synchronizer's verdict, the version's identity and the time filled in."""
    record = replace(report, expected_identity=expected, epoch=epoch, unix_ms=int(time.time() * 1000))
    if record.outcome == UpdateOutcome.VERIFIED and expected and record.resident_identity != expected:
        measured = record.resident_identity.hex()[:16] or "none (not measured)"
        return replace(
            record, outcome=UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY,
            reason=f"the resident weights' identity {measured} is not version {record.version}'s {expected.hex()[:16]}",
        )
    return record


def judge_dropped(report: UpdateRecord, rewound_to: int, epoch: int) -> UpdateRecord:
    """A report of a version a rewind dropped (one that has not been committed again since): whatever
    the replica measured, it holds a lost lineage's weights, never verified in this one."""
    return replace(
        report, outcome=UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY, epoch=epoch,
        unix_ms=int(time.time() * 1000),
        reason=f"version {report.version} was dropped by a rewind (the last went back to version {rewound_to}, "
               f"lineage {epoch}): these weights are a lost lineage's",
    )


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
