"""The tiny quickstart with one replica at a far site: real processes on both ends of an emulated
slow, lossy link (100 Mbit/s, 40 ms round trip, 0.1 % loss; flywheel/testing/link_emulator.py).

Near end: the synchronizer, the trainer, the controller and replica r0. Far end: a relay (a
synchronizer in relay mode) and replica r1, whose site label makes it pull its versions from the
relay it finds in the synchronizer's registry; it registers, heartbeats and reports to the
synchronizer across the link, and the controller sends it work across the link. What must hold:
the run completes; both replicas generate trained samples; every trained sample's version is within
the mode's bound (batch-async, threshold 1: at most one version behind the one trained); r1's
updates verify; the versions r1 installed came through the relay (its fetch log).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flywheel.testing.link_emulator import EmulatedLink, available
from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run

WHY_NOT = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")]

STEPS = 8
SYNC, TRAINER, R0, RELAY, R1 = 52001, 52002, 52003, 52004, 52005


def namespace_python(tmp_path: Path, link: EmulatedLink, side: str) -> str:
    """An interpreter that runs inside one end of the link (start_service runs `python -m ...`)."""
    wrapper = tmp_path / f"python-{side}"
    wrapper.write_text(f"#!/bin/sh\nexec ip netns exec {link.namespaces[side]} {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def rollout(name: str, model: Path, synchronizer: str, host: str, port: int, **link_fields) -> dict:
    return {
        "server": {"host": "0.0.0.0"}, "http_port": 0,
        "engine": {"kind": "transformers", "model_path": str(model),
                   "args": {"dtype": "float32", "max_model_len": 256, "seed": 0}},
        "synchronizer": {"address": synchronizer, "component_id": name, "advertise_address": f"{host}:{port}",
                         "heartbeat_interval_seconds": 0.5, "retry_max_seconds": 1.0, **link_fields},
    }


@pytest.mark.timeout(900)
def test_a_run_with_a_far_replica_behind_a_relay_completes_within_its_staleness_bound(tmp_path: Path) -> None:
    model = prepare_tiny_model()
    run_dir = tmp_path / "run"
    with EmulatedLink(rate_bits=100e6, delay=0.020, loss=0.001) as link:
        near, far = namespace_python(tmp_path, link, "near"), namespace_python(tmp_path, link, "far")
        synchronizer = f"{link.near_address}:{SYNC}"
        cluster = Cluster(tmp_path)
        try:
            cluster.start("synchronizer", "synchronizer",
                          {"server": {"host": "0.0.0.0"}, "checkpoint_root": str(tmp_path)}, SYNC, python=near)
            cluster.start("trainer", "trainer", {
                "server": {"host": "0.0.0.0"},
                "model": {"path": str(model), "cpu_threads": 1}, "optimizer": {"lr": 1e-4},
                "checkpoint": {"dir": str(tmp_path / "checkpoints")},
                "sync": {"synchronizer_address": synchronizer, "advertise_address": f"{link.near_address}:{TRAINER}"},
            }, TRAINER, python=near)
            cluster.start("r0", "rollout", rollout("r0", model, synchronizer, link.near_address, R0), R0, python=near)
            cluster.start("relay", "synchronizer", {
                "server": {"host": "0.0.0.0"},
                "relay": {"upstream": synchronizer, "site": "far", "advertise_address": f"{link.far_address}:{RELAY}",
                          "heartbeat_interval_seconds": 0.5},
            }, RELAY, python=far)
            cluster.start("r1", "rollout", rollout("r1", model, synchronizer, link.far_address, R1, site="far"), R1,
                          python=far)
            for name in ("synchronizer", "trainer", "r0", "relay", "r1"):
                cluster[name].wait_ready(300)
            run = tiny_run("far", STEPS, synchronizer, f"{link.near_address}:{TRAINER}")
            controller = cluster.controller(run, run_dir, python=near)
            try:
                assert controller.wait(420) == 0, cluster.controller_output()
            finally:
                if controller.poll() is None:
                    controller.kill()
        finally:
            cluster.stop()
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    threshold = run["staleness"]["threshold"]
    for row in rows:
        assert all(row["trained_version"] - start <= threshold for start, _ in row["sample_versions"]), row
    engines = {engine for row in rows for engine in row["sample_engines"]}
    assert engines == {"r0", "r1"}, engines
    events = jsonl(run_dir / "synchronizer_events.jsonl")
    r1_updates = [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED" and e["update"]["id"] == "r1"]
    assert r1_updates and all(u["outcome"] == "VERIFIED" for u in r1_updates), r1_updates
    relayed = (tmp_path / "relay" / "synchronizer.log").read_text().count("relay fetched a version")
    assert relayed >= len(r1_updates), f"{relayed} versions came through the relay, r1 installed {len(r1_updates)}"
