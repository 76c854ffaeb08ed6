"""Rollout replicas join, die and come back mid-run; the run goes on and loses nothing.

Real processes: a synchronizer, a trainer and rollout replicas (the transformers
engine on a tiny model, to keep four model processes within two cores), and
the controller driving them through `services:` with no rollout list, so its
replicas are the ones registered with the synchronizer. The run is
fully-async, so every replica has work whenever it serves.

1. Two replicas, r0 and r1, serve from the start.
2. A third, r2, starts mid-run: it catches up to the synchronizer's newest
   version before it serves, so its first sample is from that version or newer,
   and it gets work.
3. r0 is SIGKILLed mid-run: its requests fail over to the others, the run goes
   on, and the ledger shows every task trained exactly once.
4. r0 restarts on the same address and id: it catches up and gets work again.
5. The run is stopped as a user stops it (SIGINT: after a checkpoint), with no step lost.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.run_records import RunRecords, samples_of
from tests.integration.service_processes import Cluster, prepare_tiny_model, tiny_run, wait_for

pytestmark = pytest.mark.slow

#: More than a replica needs to load its model twice mid-run (about 1.5 s a step here): the tests
#: stop the run once what they watch has happened.
STEPS = 200


@pytest.mark.timeout(900)
def test_replicas_join_die_and_rejoin_without_losing_a_task(tmp_path: Path) -> None:
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    records = RunRecords(run_dir)

    def latest_version() -> int:
        return max((e["latest_version"] for e in records.events()), default=0)

    try:
        # Short leases: a killed replica is dropped within seconds.
        sync = cluster.synchronizer(lease_seconds=3.0, sweep_interval_seconds=0.2)
        trainer = cluster.trainer(model, sync)
        for name in ("r0", "r1"):
            cluster.rollout(name, model, sync)
        for name in ("trainer", "r0", "r1"):
            cluster[name].wait_ready(300)
        r0_port = int(cluster["r0"].grpc_address.rsplit(":", 1)[1])
        run = tiny_run("elastic", STEPS, sync, trainer.grpc_address, mode="fully-async")
        run["worker"]["max_retries"] = 10
        controller = cluster.controller(run, run_dir)
        try:
            # 2. A third replica joins mid-run: it catches up before its first generation, then gets work.
            wait_for(lambda: len(records.ledger()) >= 3, 300, "3 steps", controller)
            joined_at = latest_version()  # r2 catches up to this version or a newer one
            cluster.rollout("r2", model, sync).wait_ready(300)
            first = wait_for(lambda: samples_of(records.ledger(), "r2"), 300, "work on r2", controller)
            assert first[0][1] >= joined_at, "r2 generated before it caught up"

            # 3. r0 dies mid-run; the others carry on.
            cluster["r0"].process.send_signal(signal.SIGKILL)
            killed_at = len(records.ledger())
            wait_for(lambda: len(records.ledger()) >= killed_at + 2, 300, "2 steps after the kill", controller)
            # Its lease lapses (3 s) before it comes back: a restart quicker than that (a fork of the tests'
            # preloaded interpreter is ready in under a second) would re-register a replica never seen gone.
            wait_for(lambda: "STOPPED" in [e["state"] for e in records.events() if e.get("id") == "r0"], 60,
                     "r0's lease to lapse", controller)

            # 4. r0 restarts on the same address and id: it catches up, then gets work again.
            restarted_at = latest_version()
            again = cluster.rollout("r0@again", model, sync, port=r0_port)
            again.wait_ready(300)
            assert again.grpc_address.endswith(f":{r0_port}")
            back = wait_for(lambda: [s for s in samples_of(records.ledger(), "r0") if s[0] > killed_at + 2], 300,
                            "work on r0 after its restart", controller)
            assert min(v for _, v, _ in back) >= restarted_at, "the restarted r0 served its base weights"
            cluster.stop_the_run(controller)
        finally:
            if controller.poll() is None:
                controller.kill()
        rows = records.ledger()
        assert len(rows) < STEPS and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        trained = [task for row in rows for task in row["tasks"]]
        assert len(trained) == len(set(trained)) == 4 * len(rows), "a task was lost or trained twice"
        # The synchronizer saw r0 leave and come back.
        r0 = [e["state"] for e in records.events() if e.get("id") == "r0"]
        assert "STOPPED" in r0 and r0.index("STOPPED") < len(r0) - 1
    finally:
        cluster.stop()


@pytest.mark.timeout(900)
def test_a_replica_that_joins_an_nccl_run_is_sent_the_newest_version_before_it_serves(tmp_path: Path) -> None:
    """NCCL versions are kept nowhere to pull from: the synchronizer asks the trainer to broadcast the
    newest one again to the late replica (gloo on CPU), whose first sample is on it, not on its base weights.
    FIXED(4): between broadcasts the trainer has moved on, so a late replica must wait for it to come round.
    The run is long enough for that: r1 starts in 5-30 s (load), the trainer makes about two steps a second,
    and with 16 steps r1 registered at version 8, missed 12 (the trainer held 13) and the run ended at 16.
    The run is stopped once r1 has generated."""
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    records = RunRecords(run_dir)

    try:
        sync = cluster.synchronizer()
        trainer = cluster.trainer(model, sync)
        cluster.rollout("r0", model, sync)
        for name in ("trainer", "r0"):
            cluster[name].wait_ready(300)
        run = tiny_run("nccl-join", STEPS, sync, trainer.grpc_address, mode="fully-async",
                       sync={"method": "nccl", "interval": 4})
        controller = cluster.controller(run, run_dir)
        try:
            wait_for(lambda: any(e["kind"] == "VERSION_COMMITTED" for e in records.events()), 300, "a broadcast",
                     controller)
            joined_at = max(e["latest_version"] for e in records.events())
            assert joined_at >= 4
            cluster.rollout("r1", model, sync).wait_ready(300)
            first = wait_for(lambda: samples_of(records.ledger(), "r1"), 300, "work on r1", controller)
            assert min(v for _, v, _ in first) >= joined_at, "r1 generated on its base weights"
            cluster.stop_the_run(controller)
        finally:
            if controller.poll() is None:
                controller.kill()
        r1 = [e for e in records.events() if e.get("id") == "r1"]
        assert r1[0]["kind"] == "COMPONENT_REGISTERED" and r1[0]["weight_version"] == 0
        # The version that was newest when r1 registered (the trainer may have moved on since joined_at).
        behind = r1[0]["latest_version"]
        assert any(e["kind"] == "SYNC_REQUESTED" and e["version"] == behind for e in r1), r1
        assert min(v for _, v, _ in samples_of(records.ledger(), "r1")) >= behind, \
            "r1 generated before it was sent the newest"
        assert any(e["weight_version"] >= behind for e in r1 if e["kind"] != "COMPONENT_REGISTERED")
    finally:
        cluster.stop()
