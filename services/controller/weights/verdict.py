"""The fleet's verdict on one weight version: which replicas proved they hold
it, which were quarantined, which serve it unproven, which have not reported.

A replica's reports (UPDATE_REPORTED, each an `UpdateRecord` with its
`UpdateCoverage`) are judged by the synchronizer; this module reads them from
the controller's seat, per live replica of the pool:

- **verified**: it reported VERIFIED for the version, or for a newer one (it
  holds proven weights at least that new), whatever happened to it since (a
  later update may have failed: the tokens it made on this version were
  made on proven weights);
- **quarantined**: it failed the version (or is quarantined now and proved
  nothing at least that new), with the reason;
- **unverified**: it reported UNVERIFIED (not every tensor measured) and is
  *not* quarantined: the synchronizer's policy accepted unproven weights.
  Such a replica serves, but is no proof;
- **pending**: healthy, and no report yet.

`verdict_metrics` and `verdict_json` write a verdict out: numbers for
metrics.jsonl and Prometheus (no strings there), words for the status page.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flywheel.synchronizer.types import UpdateOutcome, UpdateRecord
from services.controller.rollouts.balancer import Replica


@dataclass
class FleetVerdict:
    """What the fleet made of one version."""

    version: int
    verified: list[str] = field(default_factory=list)
    #: Replica -> why it is out of service.
    quarantined: dict[str, str] = field(default_factory=dict)
    #: Replica -> what it measured: serving the version unproven (the run's policy accepted it).
    unverified: dict[str, str] = field(default_factory=dict)
    #: Live replicas with no result for this version yet.
    pending: list[str] = field(default_factory=list)
    #: Replica -> the report its place above rests on (with the coverage it measured).
    records: dict[str, UpdateRecord] = field(default_factory=dict)

    @property
    def settled(self) -> bool:
        """Every live replica verified the version or is quarantined with a reason."""
        return not self.pending

    @property
    def usable(self) -> bool:
        """Tokens of this version may be trained on: a replica proved it, or serves it under a
        policy that accepts unverified updates."""
        return bool(self.verified or self.unverified)

    def describe(self) -> str:
        parts = [f"verified: {', '.join(self.verified) or 'none'}"]
        if self.quarantined:
            parts.append("quarantined: " + "; ".join(f"{r} ({why})" for r, why in self.quarantined.items()))
        if self.unverified:
            parts.append("unverified: " + "; ".join(f"{r} ({what})" for r, what in self.unverified.items()))
        if self.pending:
            parts.append(f"no report yet: {', '.join(self.pending)}")
        return "; ".join(parts)


def judge(version: int, replicas: Iterable[Replica], results: Mapping[int, Mapping[str, UpdateRecord]]) -> FleetVerdict:
    """The verdict on `version` from the pool's replicas and the reports heard (version -> replica -> its
    latest report of that version)."""
    verdict = FleetVerdict(version)
    for replica in replicas:
        name = replica.name
        mine = sorted(((v, by[name]) for v, by in results.items() if v >= version and name in by), key=lambda p: p[0])
        proof = next((r for _, r in mine if r.verified), None)
        own = next((r for v, r in mine if v == version), None)
        if proof is not None:
            verdict.verified.append(name)
            verdict.records[name] = own if own is not None and own.verified else proof
        elif replica.quarantined:
            verdict.quarantined[name] = replica.quarantine_reason or (own.reason if own else "")
            if own is not None:
                verdict.records[name] = own
        elif own is not None and own.outcome == UpdateOutcome.UNVERIFIED:
            verdict.unverified[name] = own.coverage.describe()
            verdict.records[name] = own
        elif own is not None and own.outcome == UpdateOutcome.FAILED:
            # The report arrived before the synchronizer's flag on the replica did.
            verdict.quarantined[name] = own.reason or "its update failed"
            verdict.records[name] = own
        elif replica.healthy:
            verdict.pending.append(name)
    return verdict


def verdict_metrics(verdict: FleetVerdict) -> dict[str, float]:
    """The verdict as step metrics: counts (verdict/*) and each reporting replica's coverage
    (coverage/<replica>/*: tensors of the version, those measured and how, the probe's largest
    and median differences in nats and the held one as a share of its tolerance when a probe ran, the outcome as UpdateOutcome's number)."""
    m = {
        "verdict/version": float(verdict.version),
        "verdict/verified_replicas": float(len(verdict.verified)),
        "verdict/quarantined_replicas": float(len(verdict.quarantined)),
        "verdict/unverified_replicas": float(len(verdict.unverified)),
        "verdict/pending_replicas": float(len(verdict.pending)),
    }
    for name, record in verdict.records.items():
        c, prefix = record.coverage, f"coverage/{name}"
        m[f"{prefix}/version"] = float(record.version)
        m[f"{prefix}/outcome"] = float(int(record.outcome))
        m[f"{prefix}/tensors"] = float(c.tensors)
        m[f"{prefix}/covered_tensors"] = float(c.resident_tensors + c.received_tensors)
        m[f"{prefix}/resident_tensors"] = float(c.resident_tensors)
        m[f"{prefix}/received_tensors"] = float(c.received_tensors)
        if c.probe.ran:
            m[f"{prefix}/probe_max_abs_diff"] = c.probe.max_abs_diff
            m[f"{prefix}/probe_median_abs_diff"] = c.probe.median_abs_diff
            # The statistic the check held, as a share of its bound (<= 1 passed): comparable across engines and
            # dtypes, whose checks hold different statistics to tolerances four decades apart.
            if c.probe.tolerance > 0:
                m[f"{prefix}/probe_held_vs_tolerance"] = c.probe.held / c.probe.tolerance
    return m


def coverage_json(record: UpdateRecord) -> dict[str, Any]:
    c = record.coverage
    return {
        "version": record.version, "outcome": record.outcome.name, "methods": c.methods, "complete": c.complete,
        "tensors": c.tensors, "covered_tensors": c.resident_tensors + c.received_tensors,
        "resident_tensors": c.resident_tensors, "received_tensors": c.received_tensors,
        "probe": ({"tokens": c.probe.tokens, "max_abs_diff": c.probe.max_abs_diff,
                   "median_abs_diff": c.probe.median_abs_diff, "statistic": c.probe.statistic.name.lower(),
                   "tolerance": c.probe.tolerance, "passed": c.probe.passed} if c.probe.ran else None),
        "describe": c.describe(),
    }


def verdict_json(verdict: FleetVerdict) -> dict[str, Any]:
    """The verdict for the status page (words allowed)."""
    return {
        "version": verdict.version, "verified": list(verdict.verified), "quarantined": dict(verdict.quarantined),
        "unverified": dict(verdict.unverified), "pending": list(verdict.pending),
        "coverage": {name: coverage_json(record) for name, record in verdict.records.items()},
    }
