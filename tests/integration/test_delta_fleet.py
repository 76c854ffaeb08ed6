"""A run whose replica pulls every version as a delta from the weights it serves.

Real processes: a synchronizer, a trainer and two rollout replicas (transformers engine, tiny
model), the controller driving a sync run. r0 asks for deltas (`updates.delta_pulls: on`), r1
pulls full versions (`off`). What must hold: the run finishes; every update of both replicas is
verified on the resident weights (so r0's rebuilt versions are bit for bit the trainer's: the
same identity as r1's full pulls); the synchronizer served r0 deltas, not full versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run
from tests.integration.test_synchronizer_weights import metric

pytestmark = pytest.mark.slow

STEPS = 8



@pytest.mark.timeout(600)
def test_a_replica_that_pulls_deltas_serves_the_same_verified_versions(tmp_path: Path) -> None:
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    try:
        sync = cluster.synchronizer(keep_versions=3)
        trainer = cluster.trainer(model, sync)
        cluster.rollout("r0", model, sync, updates={"delta_pulls": "on"})
        cluster.rollout("r1", model, sync, updates={"delta_pulls": "off"})
        for name in ("trainer", "r0", "r1"):
            cluster[name].wait_ready(300)
        controller = cluster.controller(tiny_run("deltas", STEPS, sync, trainer.grpc_address), run_dir)
        try:
            assert controller.wait(480) == 0, cluster.controller_output()
        finally:
            if controller.poll() is None:
                controller.kill()
        events = jsonl(run_dir / "synchronizer_events.jsonl")
        updates = [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED"]
        by_replica = {r: {u["version"]: u for u in updates if u["id"] == r} for r in ("r0", "r1")}
        assert all(u["outcome"] == "VERIFIED" for u in updates), [u for u in updates if u["outcome"] != "VERIFIED"]
        shared = sorted(set(by_replica["r0"]) & set(by_replica["r1"]))
        assert len(shared) >= STEPS // 2, by_replica  # a replica may skip a version the other took
        for version in shared:  # the delta-rebuilt weights are the full version's, bit for bit
            assert by_replica["r0"][version].get("identity")
            assert by_replica["r0"][version]["identity"] == by_replica["r1"][version]["identity"]
        metrics = cluster["synchronizer"].metrics_url
        deltas = metric(metrics, 'flywheel_synchronizer_delta_pulls_total{sent="delta"}')
        # r0's first pull has no verified base (it serves the model it started with); every later one is a delta.
        assert deltas >= len(by_replica["r0"]) - 1, deltas
    finally:
        cluster.stop()
