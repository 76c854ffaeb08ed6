"""The controller's side of the one road, in simulated runs on a virtual clock: it moves no
weights, hands the synchronizer the run's policy (pause mode included), asks for the versions
a run needs off the schedule, and keeps a quarantined replica out of every rollout until an
update of it verifies, while the run goes on with the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.controller.loop import run
from services.controller.telemetry.errors_report import RunStopped
from services.controller.testing.simulated import run_virtual
from tests.unit.controller.controller_helpers import config, simulated_pipeline


def test_the_policy_with_its_pause_mode_goes_to_the_synchronizer_and_the_trainer_publishes() -> None:
    cfg = config(mode="batch-async", run={"max_steps": 6}, sync={"interval": 2, "offset": 1, "pause_mode": "abort"},
                 staleness={"threshold": 2})
    p, trainer, engines = simulated_pipeline(cfg, seed=1)
    sync = p.fleet.synchronizer
    summary = run_virtual(run(p))
    assert summary.steps == 6
    assert sync.configured == dict(style="fixed", method="memory", interval=2, offset=1, timeout_seconds=120.0,
                                   rollout_wait="staleness", max_staleness=2, pause_mode="abort")
    # FIXED(2, 1): the trainer published every second version by itself; the controller exported nothing.
    assert trainer.published == [2, 4, 6]
    assert all(u.verified for e in engines for u in e.updates)


def test_a_version_off_the_schedule_is_asked_for_and_published() -> None:
    """Validation measures version 3 under FIXED(10): the synchronizer asks, the trainer publishes it."""
    cfg = config(mode="sync", run={"max_steps": 3}, sync={"interval": 10},
                 data={"validation": {"items": [{"prompt": "q", "answer": "1"}] * 4}},
                 validation={"interval": 3})
    p, trainer, _ = simulated_pipeline(cfg, seed=2)
    summary = run_virtual(run(p))
    assert summary.steps == 3 and trainer.published == [3]
    assert p.fleet.newest.value == 3


def test_a_replica_whose_update_fails_gets_no_work_until_one_verifies(tmp_path: Path) -> None:
    from services.controller.telemetry.metrics_log import JsonlSink as Sink

    cfg = config(mode="fully-async", run={"max_steps": 30}, metrics={"jsonl": True})
    p, trainer, engines = simulated_pipeline(cfg, seed=3, replicas=2, update_time=0.01)
    p.metrics.add(Sink(tmp_path / "metrics.jsonl"))
    faulty = engines[1]
    faulty.fail_updates = lambda version: version <= 10  # it loads versions 1-10 wrong
    summary = run_virtual(run(p))
    assert summary.steps == 30
    failed = [u.version for u in faulty.updates if not u.verified]
    rejoined = min(u.version for u in faulty.updates if u.verified)
    assert failed and max(failed) <= 10 < rejoined
    # Nothing it generated on the weights it failed to load, until the version it rejoined with.
    bad = [g for g in faulty.generated if min(failed) <= g.version_start < rejoined]
    assert not bad, bad[:3]
    assert [g for g in faulty.generated if g.version_start >= rejoined], "it took work again"
    assert engines[0].generated and all(u.verified for u in engines[0].updates)
    # The fleet's verdict, per version.
    verdict = p.fleet.verdict(max(failed))
    assert not verdict.pending and set(verdict.verified) == {e.name for e in engines}  # it verified a newer one
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(m["fleet/quarantined"] == 1.0 for m in lines) and lines[-1]["fleet/quarantined"] == 0.0
    assert any(m["update/failed"] > 0 for m in lines) and all("update/verified" in m for m in lines)
    assert any("update/pause_seconds_max" in m for m in lines)


def test_a_replica_ahead_of_the_trainer_stops_the_run_with_a_clear_error() -> None:
    cfg = config(run={"max_steps": 2})
    p, _, engines = simulated_pipeline(cfg, seed=4)
    sync = p.fleet.synchronizer
    sync.registered[engines[0].name].weight_version = 5  # weights an earlier trainer made
    with pytest.raises(RunStopped, match="serve weights newer than the trainer's version 0; restart them"):
        run_virtual(run(p))
    assert p.state.steps_done == 0
