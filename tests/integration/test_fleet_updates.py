"""A fleet update is a verified transaction: a replica whose update fails is quarantined, gets no
work, and rejoins only through an update that verifies; the run goes on with the others.

Real processes: a synchronizer, a trainer and two rollout replicas on a tiny model, the controller
driving them; fully-async, so each replica has work whenever it serves. One run per engine (the
transformers engine, and vLLM on CPU, whose linear layers are repacked and cannot be read back). r1
is given each fault class of `LoadFaults` in turn through its faults file, and each must be caught:
- (a) one element changed in a tensor the engine keeps readable (RESIDENT catches it);
- (b) a linear layer's weight scaled by 1.01 after loading (on vLLM only the probe can see it);
- (c) two same-shaped linear weights swapped by the loader (RESIDENT; on vLLM the probe);
- (d) one tensor left at the previous version (RESIDENT; on vLLM the loader's own per-layer count
  of what it copied, which fails the version as it is prepared, before anything live is touched);
- (e) the load raising RuntimeError halfway (an exception in apply).
For each, from the run's own records (the synchronizer's events as the controller watched them, and
the ledger of trained samples with the replica that made each):
- r1's update is reported FAILED in the phase that catches the fault, and r1 is quarantined;
- while quarantined, no trained sample comes from r1 (none made on the failed version or after,
  until the version it rejoined with), and the run goes on on r0;
- once the fault is cleared, r1's next update verifies (full coverage), and it takes work again.
Then the run is stopped as a user stops it (SIGINT: after a checkpoint), with no step lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.run_records import RunRecords, samples_of, updates_of
from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run, wait_for

pytestmark = pytest.mark.slow

#: More than the five faults need (each: fail, sit out, rejoin, while the run goes on): the test stops
#: the run once r1 is back at work after the last.
STEPS = 2000

#: fault -> (its faults-file keys, the phase that catches it on the transformers engine, on vLLM). A partial
#: load (d): vLLM's loader finds the layer short of its weights as it loads, which with
#: updates.prepare_outside_pause (the default) is before the pause, in the transfer.
FAULTS = {
    "a": ({"corrupt_readable": True}, "VERIFY", "VERIFY"),
    "b": ({"scale_linear": 1.01}, "VERIFY", "VERIFY"),
    "c": ({"swap_same_shaped": True}, "VERIFY", "VERIFY"),
    "d": ({"skip_one": True}, "VERIFY", "TRANSFER"),
    "e": ({"raise_halfway": True}, "APPLY", "APPLY"),
}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_every_load_fault_is_caught_quarantined_and_the_replica_rejoins_once_an_update_verifies(
    tmp_path: Path, engine: str,
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    faults = tmp_path / "r1-faults.json"

    records = RunRecords(run_dir)

    try:
        sync = cluster.synchronizer(lease_seconds=5.0, sweep_interval_seconds=0.2)
        trainer = cluster.trainer(model, sync)
        cluster.rollout("r0", model, sync, engine=engine)
        cluster.rollout("r1", model, sync, engine=engine,
                        updates={"faults_file": str(faults), "apply_timeout_seconds": 30.0})
        for name in ("trainer", "r0", "r1"):
            cluster[name].wait_ready(300)
        run = tiny_run("fleet", STEPS, sync, trainer.grpc_address, mode="fully-async")
        run["worker"]["max_retries"] = 10
        controller = cluster.controller(run, run_dir)
        windows: list[tuple[str, int, int]] = []  # (fault, failed version, version r1 rejoined with)
        try:
            wait_for(lambda: [u for u in updates_of(records.events(), "r1") if u["outcome"] == "VERIFIED"], 300,
                     "r1's first verified update", controller)
            for name, (keys, caught_by_transformers, caught_by_vllm) in FAULTS.items():
                since = len(updates_of(records.events(), "r1"))
                faults.write_text(json.dumps(keys))
                failed = wait_for(
                    lambda: [u for u in updates_of(records.events(), "r1")[since:] if u["outcome"] == "FAILED"],
                    300, f"r1's update failing on fault {name}", controller)[0]
                phase = caught_by_vllm if engine == "vllm" else caught_by_transformers
                assert failed["failed_phase"] == phase, (name, failed)
                assert wait_for(lambda: [e for e in records.events() if e.get("id") == "r1" and e.get("quarantined")],
                                60, "r1 quarantined", controller)
                quarantined_at = len(records.ledger())
                wait_for(lambda: len(records.ledger()) >= quarantined_at + 2, 300, "2 steps on r0 alone", controller)
                faults.unlink()  # the fault is cleared: r1's next update verifies
                rejoined = wait_for(
                    lambda: [u for u in updates_of(records.events(), "r1")[since:] if u["outcome"] == "VERIFIED"
                             and u["version"] >= failed["version"]], 300, "r1's update verifying", controller)[0]
                coverage = rejoined["coverage"]
                assert coverage["resident_tensors"] + coverage["received_tensors"] == coverage["tensors"] > 0
                if engine == "vllm":  # its repacked layers are covered by RECEIVED and the probe
                    assert coverage["received_tensors"] > 0 and coverage["probe"]["passed"], coverage
                wait_for(lambda: [s for s in samples_of(records.ledger(), "r1") if s[1] >= rejoined["version"]], 300,
                         "work on r1 after it rejoined", controller)
                windows.append((name, failed["version"], rejoined["version"]))
            cluster.stop_the_run(controller)
        finally:
            if controller.poll() is None:
                controller.kill()
        rows = records.ledger()
        assert len(rows) < STEPS, "the run was to be stopped, not finish"
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        for name, failed_version, rejoined_version in windows:
            # No trained sample made by r1 on weights from its failed version until the one it rejoined with.
            bad = [s for s in samples_of(rows, "r1") if failed_version <= s[2] < rejoined_version]
            assert not bad, f"fault {name}: r1 generated while quarantined: {bad[:5]}"
        assert samples_of(rows, "r0"), "r0 carried the run"
        timed = [u for u in updates_of(records.events(), "r0") if u["outcome"] == "VERIFIED"]
        assert timed and all(u["verify_seconds"] > 0 and u["pause_seconds"] > 0 for u in timed)
        # The run's metrics carry the fleet: the quarantined replica counted while it was out.
        metrics = jsonl(run_dir / "metrics.jsonl")
        assert any(m.get("fleet/quarantined", 0) >= 1 for m in metrics)
        assert any("update/pause_seconds_max" in m for m in metrics)
    finally:
        cluster.stop()
