"""A fleet update is a verified transaction: a replica whose update fails is quarantined, gets no
work, and rejoins only through an update that verifies; the run goes on with the others.

Real processes: a synchronizer, a trainer and two rollout replicas (the transformers engine on a
tiny model), the controller driving them; fully-async, so each replica has work whenever it
serves. r1 carries a fault from the start (its faults file):
- corrupt: its engine changes one element of a loaded tensor after the transfer succeeded;
  verification (the identity of the resident weights against the version's) catches it;
- hang: its apply hangs past updates.apply_timeout_seconds.
What must hold, from the run's own records (the synchronizer's events as the controller watched
them, and the ledger of trained samples with the replica that made each):
- r1's first update is reported FAILED (verify or apply), and r1 is quarantined;
- while quarantined, no trained sample comes from r1 (none made on the failed version or after,
  until the version it rejoined with);
- the run goes on on r0;
- once the fault is cleared, r1's next update verifies, it leaves quarantine, and takes work again;
- then the run is stopped as a user stops it (SIGINT: after a checkpoint), with no step lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run, wait_for

pytestmark = pytest.mark.slow

#: More than r1 needs to fail, sit out, and rejoin while the run goes on (~3 steps a second here):
#: the test stops the run once r1 is back at work.
STEPS = 300


def updates_of(events: list[dict], replica: str) -> list[dict]:
    return [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED" and e["update"]["id"] == replica]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["corrupt", "hang"])
def test_a_faulty_replica_is_quarantined_gets_no_work_and_rejoins_once_an_update_verifies(
    tmp_path: Path, fault: str,
) -> None:
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    faults = tmp_path / "r1-faults.json"
    faults.write_text(json.dumps({"corrupt_after_apply": True} if fault == "corrupt" else {"apply_delay_seconds": 20}))

    def ledger() -> list[dict]:
        return jsonl(run_dir / "trained_tasks.jsonl")

    def events() -> list[dict]:
        return jsonl(run_dir / "synchronizer_events.jsonl")

    try:
        sync = cluster.synchronizer(lease_seconds=5.0, sweep_interval_seconds=0.2)
        trainer = cluster.trainer(model, sync)
        cluster.rollout("r0", model, sync)
        cluster.rollout("r1", model, sync, updates={"faults_file": str(faults), "apply_timeout_seconds": 2.0})
        for name in ("trainer", "r0", "r1"):
            cluster[name].wait_ready(300)
        run = tiny_run("fleet", STEPS, sync, trainer.grpc_address, mode="fully-async")
        run["worker"]["max_retries"] = 10
        controller = cluster.controller(run, run_dir)
        try:
            failed = wait_for(lambda: [u for u in updates_of(events(), "r1") if u["outcome"] == "FAILED"], 300,
                              "r1's update failing", controller)[0]
            assert failed["failed_phase"] == ("VERIFY" if fault == "corrupt" else "APPLY"), failed
            assert wait_for(lambda: [e for e in events() if e.get("id") == "r1" and e.get("quarantined")], 60,
                            "r1 quarantined", controller)
            quarantined_at = len(ledger())
            # The run goes on without r1.
            wait_for(lambda: len(ledger()) >= quarantined_at + 3, 300, "3 steps on r0 alone", controller)
            faults.unlink()  # the fault is cleared: r1's next update verifies
            rejoined = wait_for(
                lambda: [u for u in updates_of(events(), "r1") if u["outcome"] == "VERIFIED"
                         and u["version"] >= failed["version"]], 300, "r1's update verifying", controller)[0]
            back = wait_for(lambda: [s for s in samples_of(ledger(), "r1") if s[1] >= rejoined["version"]], 300,
                            "work on r1 after it rejoined", controller)
            assert back
            cluster.stop_the_run(controller)
        finally:
            if controller.poll() is None:
                controller.kill()
        rows = ledger()
        assert len(rows) < STEPS, "the run was to be stopped, not finish"
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        # No trained sample made by r1 on weights from its failed version until the one it rejoined with.
        bad = [s for s in samples_of(rows, "r1") if failed["version"] <= s[2] < rejoined["version"]]
        assert not bad, f"r1 generated while quarantined: {bad[:5]}"
        assert samples_of(rows, "r0"), "r0 carried the run"
        timed = [u for u in updates_of(events(), "r0") if u["outcome"] == "VERIFIED"]
        assert timed and all(u["verify_seconds"] > 0 and u["pause_seconds"] > 0 for u in timed)
        # The run's metrics carry the fleet: the quarantined replica counted while it was out.
        metrics = jsonl(run_dir / "metrics.jsonl")
        assert any(m.get("fleet/quarantined", 0) >= 1 for m in metrics)
        assert any("update/pause_seconds_max" in m for m in metrics)
    finally:
        cluster.stop()


def samples_of(rows: list[dict], replica: str) -> list[tuple[int, int, int]]:
    """(step, version_start, version_end) of every trained sample the replica generated."""
    return [(row["step"], start, end) for row in rows
            for (start, end), engine in zip(row["sample_versions"], row["sample_engines"]) if engine == replica]
