"""The fleet's verdict on the weights a run trains on (weights/verdict.py, weights/fleet.py,
pipeline.weights_verified): before each step, every version the batch's tokens came from must
have a replica that verified it; the verdict and what each replica measured are recorded in
metrics.jsonl, /metrics and the status page. Simulated runs on a virtual clock."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from flywheel.probe import ProbeCheck
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import (
    Component, EventKind, Identity, Role, UpdateCoverage, UpdateOutcome, UpdatePhase, UpdateRecord,
)
from services.controller.loop import run
from services.controller.rollouts.balancer import EnginePool
from services.controller.telemetry.metrics_log import JsonlSink
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedSynchronizer, run_virtual
from services.controller.weights.observer import event_record
from services.controller.weights.verdict import judge
from tests.unit.controller.controller_helpers import config, simulated_pipeline

FULL = UpdateCoverage(8, 800, resident_tensors=8, resident_bytes=800)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_versions(trainer) -> set[int]:
    return {v for _, versions in trainer.trained for v in versions}


@dataclass
class ReportsLost(SimulatedSynchronizer):
    """A synchronizer that never hears the update reports of versions >= `lost_from` (a replica
    whose reporting broke): the replica serves them, proven by nobody."""

    lost_from: int = 3

    def report(self, record: UpdateRecord) -> None:
        if record.version < self.lost_from:
            super().report(record)


@pytest.mark.parametrize("mode", ["sync", "batch-async", "fully-async"])
def test_tokens_of_a_version_no_replica_proved_are_not_trained_and_the_run_stops_saying_why(mode: str) -> None:
    cfg = config(mode=mode, run={"max_steps": 30}, sync={"verify_timeout_seconds": 30})
    p, trainer, engines = simulated_pipeline(cfg, seed=5, synchronizer=ReportsLost())
    summary = run_virtual(run(p))
    assert summary.steps < 30
    assert max(trained_versions(trainer)) < 3, "trained on tokens of a version nobody verified"
    unproven = min(u.version for u in engines[0].updates if u.version >= 3)  # fully-async may skip some
    assert (f"no rollout replica verified weight version {unproven} within 30 s (sync.verify_timeout_seconds)"
            in summary.stop_reason), summary.stop_reason
    assert "verified: none" in summary.stop_reason and "no report yet: sim-0" in summary.stop_reason


def test_the_verdict_and_each_replicas_coverage_are_in_metrics_jsonl(tmp_path: Path) -> None:
    cfg = config(mode="sync", run={"max_steps": 12})
    p, trainer, engines = simulated_pipeline(cfg, seed=6, replicas=2)
    p.metrics.add(JsonlSink(tmp_path / "metrics.jsonl"))
    engines[0].measures = lambda version: replace(FULL, probe=ProbeCheck(True, 252, 0.004, 0.001, 0.05, True))
    engines[1].fail_updates = lambda version: 4 <= version <= 6  # it loads these wrong, then rejoins
    summary = run_virtual(run(p))
    assert summary.steps == 12
    steps = [m for m in rows(tmp_path / "metrics.jsonl") if "train/loss" in m]
    assert "verdict/version" not in steps[0]  # tokens of version 0, the base model: nothing was moved to prove
    for m in steps[1:]:
        # Sync mode: step s trains on tokens of version s - 1, every one verified by sim-0.
        assert m["verdict/version"] == m["step"] - 1 and m["verdict/verified_replicas"] >= 1
        assert m["verdict/wait_seconds"] == 0.0  # the reports were in before the tokens
        assert (m["coverage/sim-0/covered_tensors"], m["coverage/sim-0/tensors"]) == (8, 8)
        assert m["coverage/sim-0/resident_tensors"] == 8 and m["coverage/sim-0/probe_max_abs_diff"] == 0.004
        assert m["coverage/sim-0/probe_held_vs_tolerance"] == pytest.approx(0.004 / 0.05)
        assert m["coverage/sim-0/outcome"] == UpdateOutcome.VERIFIED
    failed = [m for m in steps if m.get("coverage/sim-1/outcome") == UpdateOutcome.FAILED]
    assert failed and all(m["verdict/quarantined_replicas"] == 1 for m in failed)
    assert any(m["update/failed"] > 0 for m in steps) and all("update/unverified" in m for m in steps)
    assert steps[-1]["verdict/verified_replicas"] == 2  # it rejoined through a verified update


@pytest.mark.parametrize("mode", ["fully-async", "batch-async"])
def test_the_verdict_costs_no_wait_when_replicas_report_before_they_generate(mode: str, tmp_path: Path) -> None:
    """A replica reports an update before it generates on the version: the proof is in before the
    tokens, and no step waits for it (no bubble in the asynchronous modes)."""
    cfg = config(mode=mode, run={"max_steps": 20}, staleness={"threshold": 2})
    p, _, engines = simulated_pipeline(cfg, seed=7, replicas=2, update_time=0.05)
    p.metrics.add(JsonlSink(tmp_path / "metrics.jsonl"))
    summary = run_virtual(run(p))
    assert summary.steps == 20
    steps = [m for m in rows(tmp_path / "metrics.jsonl") if "train/loss" in m]
    assert all(m["verdict/wait_seconds"] == 0.0 for m in steps)
    judged = [m for m in steps if "verdict/version" in m]
    assert max(m["verdict/version"] for m in judged) >= 10 and all(m["verdict/verified_replicas"] >= 1 for m in judged)


def test_a_replica_serving_a_version_unverified_is_no_proof_but_the_synchronizers_policy_is_obeyed(
        tmp_path: Path) -> None:
    """UNVERIFIED (not every tensor measured) under a synchronizer policy that accepts it: the replica
    serves, the run trains on, and the verdict says nobody proved the version."""
    cfg = config(mode="sync", run={"max_steps": 5})
    p, trainer, engines = simulated_pipeline(cfg, seed=8, synchronizer=SimulatedSynchronizer(accept_unverified=True))
    p.metrics.add(JsonlSink(tmp_path / "metrics.jsonl"))
    engines[0].measures = lambda version: UpdateCoverage(8, 800, resident_tensors=6, resident_bytes=600)
    summary = run_virtual(run(p))
    assert summary.steps == 5 and max(trained_versions(trainer)) == 4
    last = rows(tmp_path / "metrics.jsonl")[-1]
    assert (last["verdict/verified_replicas"], last["verdict/unverified_replicas"]) == (0, 1)
    assert (last["coverage/sim-0/covered_tensors"], last["coverage/sim-0/tensors"]) == (6, 8)
    assert last["coverage/sim-0/outcome"] == UpdateOutcome.UNVERIFIED and last["update/unverified"] == 1


def test_a_report_the_stream_missed_is_asked_for_before_anything_waits() -> None:
    """A Watch stream that reconnected (or a session that started after the report) did not hear it;
    the synchronizer keeps it (ListUpdates)."""
    cfg = config(mode="sync")
    p, _, engines = simulated_pipeline(cfg)
    sync = p.fleet.synchronizer
    sync.results.append(UpdateRecord("sim-0", 2, UpdateOutcome.VERIFIED, coverage=FULL, served_version=2))
    verdicts, waited = run_virtual(p.fleet.until_usable({0, 2}))
    assert [(v.version, v.verified) for v in verdicts] == [(2, ["sim-0"])] and waited == 0.0


def test_a_report_a_restarted_synchronizer_holds_unheard_is_found_long_before_the_verify_timeout() -> None:
    """Before, the reports were asked for once at the start and once at the end: a verdict whose report
    reached a restarted synchronizer while the controller's stream was down waited out the whole
    sync.verify_timeout_seconds (120 s by default), then trained."""
    import asyncio

    from services.controller.weights.fleet import REASK_REPORTS_SECONDS

    cfg = config(mode="sync")
    p, _, _ = simulated_pipeline(cfg)
    sync = p.fleet.synchronizer
    calls = {"n": 0}
    original = sync.updates

    async def restarted(version: int) -> list[UpdateRecord]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("synchronizer unavailable")
        return await original(version)

    sync.updates = restarted

    async def report_arrives_later() -> None:
        await asyncio.sleep(5.0)  # at the restarted synchronizer, not on the controller's stream
        sync.results.append(UpdateRecord("sim-0", 2, UpdateOutcome.VERIFIED, coverage=FULL, served_version=2))

    async def both():
        arrival = asyncio.ensure_future(report_arrives_later())
        verdicts, waited = await p.fleet.until_usable({2})
        await arrival
        return verdicts, waited

    assert p.fleet.verify_timeout_seconds == 120.0
    verdicts, waited = run_virtual(both())
    assert [(v.version, v.verified) for v in verdicts] == [(2, ["sim-0"])]
    assert 5.0 <= waited <= 5.0 + REASK_REPORTS_SECONDS, waited


def replica(name: str, *, quarantined: str = "", healthy: bool = True):
    pool = EnginePool([SimulatedRolloutEngine(name=name)])
    r = pool.replicas[0]
    r.healthy, r.quarantined, r.quarantine_reason = healthy, bool(quarantined), quarantined
    return r


def test_the_verdict_on_a_version_per_replica() -> None:
    def rec(name: str, version: int, outcome: UpdateOutcome, **kw) -> UpdateRecord:
        return UpdateRecord(name, version, outcome, served_version=version, **kw)

    replicas = [
        replica("proved"),  # verified 5
        replica("moved-on"),  # failed 5, verified 6: it holds proven newer weights
        replica("later-failed", quarantined="verify of version 6 failed"),  # verified 5, failed 6 since
        replica("failed", quarantined="verify of version 5 failed: 1 tensor differs"),
        replica("flag-not-yet"),  # its FAILED report arrived before the synchronizer's flag
        replica("unproven"),  # UNVERIFIED, serving: a policy that accepts unproven weights
        replica("silent"),  # no report yet
        replica("down", healthy=False),  # no report, not serving: not waited for
    ]
    partial = UpdateCoverage(8, 800, resident_tensors=5, resident_bytes=500)
    results = {
        5: {"proved": rec("proved", 5, UpdateOutcome.VERIFIED, coverage=FULL),
            "moved-on": rec("moved-on", 5, UpdateOutcome.FAILED, failed_phase=UpdatePhase.APPLY, reason="apply raised"),
            "later-failed": rec("later-failed", 5, UpdateOutcome.VERIFIED, coverage=FULL),
            "failed": rec("failed", 5, UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY, reason="1 tensor differs"),
            "flag-not-yet": rec("flag-not-yet", 5, UpdateOutcome.FAILED, reason="transfer cut"),
            "unproven": rec("unproven", 5, UpdateOutcome.UNVERIFIED, coverage=partial)},
        6: {"moved-on": rec("moved-on", 6, UpdateOutcome.VERIFIED, coverage=FULL),
            "later-failed": rec("later-failed", 6, UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY)},
    }
    v = judge(5, replicas, results)
    assert v.verified == ["proved", "moved-on", "later-failed"]
    assert v.quarantined == {"failed": "verify of version 5 failed: 1 tensor differs", "flag-not-yet": "transfer cut"}
    assert v.unverified == {"unproven": "5 of 8 tensors measured (5 resident, 0 as received)"}
    assert v.pending == ["silent"] and not v.settled and v.usable
    assert v.records["moved-on"].version == 6 and v.records["later-failed"].version == 5
    unproven = judge(5, [replicas[5]], results)
    assert unproven.usable and not unproven.verified  # served under the synchronizer's policy: usable, no proof
    assert not judge(5, [replicas[3], replicas[6]], results).usable


def test_an_unverified_report_is_logged_with_its_coverage() -> None:
    coverage = UpdateCoverage(8, 800, resident_tensors=2, resident_bytes=200, received_tensors=6, received_bytes=600,
                              probe=ProbeCheck(True, 252, 0.3, 0.02, 0.05, False))
    record = UpdateRecord("r0", 3, UpdateOutcome.UNVERIFIED, coverage=coverage, reason="probe failed")
    c = Component(Identity(Role.ROLLOUT, "r0"), weight_version=3)
    logged = event_record(WatchEvent(EventKind.UPDATE_REPORTED, 1, 0, 3, c, 3, None, "", None, None, "", update=record))
    assert logged["update"]["outcome"] == "UNVERIFIED" and "failed_phase" not in logged["update"]
    assert logged["update"]["coverage"]["methods"] == ["resident", "received", "probe"]
    assert (logged["update"]["coverage"]["covered_tensors"], logged["update"]["coverage"]["tensors"]) == (8, 8)
    assert logged["update"]["coverage"]["probe"]["max_abs_diff"] == 0.3 and not logged["update"]["coverage"]["complete"]


def test_the_verdict_goes_to_prometheus_with_no_per_replica_label() -> None:
    from prometheus_client import REGISTRY

    from services.controller.telemetry import metrics as prom

    def sample(name: str, **labels: str) -> float:
        value = REGISTRY.get_sample_value(name, labels)
        assert value is not None, name
        return value

    before = sample("flywheel_controller_weight_updates_total", outcome="unverified")
    waited = sample("flywheel_controller_verify_wait_seconds_total")
    prom.update_from_step({
        "update/verified": 2.0, "update/failed": 0.0, "update/unverified": 1.0, "verdict/wait_seconds": 0.25,
        "verdict/version": 7.0, "verdict/verified_replicas": 2.0, "verdict/quarantined_replicas": 1.0,
        "verdict/unverified_replicas": 0.0, "verdict/pending_replicas": 0.0,
        "coverage/r0/tensors": 8.0, "coverage/r0/covered_tensors": 8.0, "coverage/r0/probe_max_abs_diff": 0.002,
        "coverage/r0/probe_held_vs_tolerance": 0.3, "coverage/r1/probe_held_vs_tolerance": 0.6,
        "coverage/r1/tensors": 8.0, "coverage/r1/covered_tensors": 6.0,
    })
    assert sample("flywheel_controller_weight_updates_total", outcome="unverified") == before + 1
    assert sample("flywheel_controller_verify_wait_seconds_total") == waited + 0.25
    assert sample("flywheel_controller_verdict_weight_version") == 7
    assert sample("flywheel_controller_verdict_replicas", verdict="verified") == 2
    assert sample("flywheel_controller_verdict_replicas", verdict="quarantined") == 1
    assert sample("flywheel_controller_update_coverage_ratio") == 0.75
    assert sample("flywheel_controller_probe_max_abs_diff_nats") == 0.002
    assert sample("flywheel_controller_probe_held_vs_tolerance_ratio") == 0.6
    verdict_families = {"flywheel_controller_weight_updates", "flywheel_controller_verify_wait_seconds",
                        "flywheel_controller_verdict_weight_version", "flywheel_controller_verdict_replicas",
                        "flywheel_controller_update_coverage_ratio", "flywheel_controller_probe_max_abs_diff_nats",
                        "flywheel_controller_probe_held_vs_tolerance_ratio"}
    labels = {k for m in REGISTRY.collect() if m.name in verdict_families for s in m.samples for k in s.labels}
    assert labels == {"outcome", "verdict"}  # bounded label values; a replica's own figures are in metrics.jsonl


def test_the_status_page_shows_the_verdict_on_each_version_trained_on(tmp_path: Path) -> None:
    from services.controller.ops.runs import RunManager
    from services.controller.ops.status_page import PAGE, status_json

    cfg = config(mode="sync", run={"max_steps": 4})
    p, _, engines = simulated_pipeline(cfg, seed=9, replicas=2)
    engines[1].fail_updates = lambda version: version == 3
    run_virtual(run(p))
    runs = RunManager(tmp_path, lambda cfg: None)
    runs.pipeline, runs.phase = p, "completed"
    page = status_json(runs.status())
    assert [v["version"] for v in page["verdicts"]] == [3, 2, 1]
    newest = page["verdicts"][0]
    assert newest["verified"] == ["sim-0"] and newest["quarantined"]["sim-1"].startswith("verify of version 3 failed")
    assert newest["coverage"]["sim-0"]["methods"] == ["resident"] and newest["coverage"]["sim-0"]["covered_tensors"] == 8
    assert newest["coverage"]["sim-1"]["outcome"] == "FAILED"
    html = PAGE.read_text()
    assert 'id="verdicts"' in html and "renderVerdicts(s.verdicts" in html and "could not prove version" in html


def test_the_wait_is_a_setting_that_defaults_to_the_sync_timeout() -> None:
    from flywheel.runtime.config import ConfigError

    assert config(sync={"timeout_seconds": 45}).verify_timeout_seconds == 45
    assert config(sync={"verify_timeout_seconds": 5}).verify_timeout_seconds == 5
    p, _, _ = simulated_pipeline(config(sync={"verify_timeout_seconds": 5}))
    assert p.fleet.verify_timeout_seconds == 5
    with pytest.raises(ConfigError, match="sync.verify_timeout_seconds"):
        config(sync={"verify_timeout_seconds": 0})
