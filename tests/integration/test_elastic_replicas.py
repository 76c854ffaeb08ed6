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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flywheel.launcher.processes import ServiceProcess, start_service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_tasks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "synchronizer_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(check, timeout: float, what: str, controller: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if controller is not None and controller.poll() is not None:
            raise AssertionError(f"the controller exited ({controller.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def samples_of(rows: list[dict], replica: str) -> list[tuple[int, int]]:
    """(step, version_start) of every trained sample the replica generated."""
    return [(row["step"], start) for row in rows
            for (start, _), engine in zip(row["sample_versions"], row["sample_engines"]) if engine == replica]


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    from flywheel.launcher.prepare import prepare_model
    from flywheel.launcher.spec import ModelSource

    config = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    os.environ.setdefault("FLYWHEEL_MODEL_CACHE", str(tmp_path / "models"))
    return prepare_model(ModelSource(**config["launch"]["model"]))


@pytest.mark.timeout(900)
def test_replicas_join_die_and_rejoin_without_losing_a_task(tmp_path: Path, tiny_model: Path) -> None:
    services: dict[str, ServiceProcess] = {}

    def start(name: str, kind: str, config: dict, port: int = 0) -> ServiceProcess:
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        path = directory / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        args = ["--config", str(path)] + (["--server.port", str(port)] if port else [])
        child = start_service(kind, directory, args)  # a later --server.port wins over its port 0
        services[name] = child
        return child

    try:
        sync = start("synchronizer", "synchronizer", {"lease_seconds": 3.0, "sweep_interval_seconds": 0.2})
        sync.wait_ready(60)
        sync_address = sync.grpc_address
        trainer = start("trainer", "trainer", {
            "model": {"path": str(tiny_model), "cpu_threads": 1},
            "optimizer": {"lr": 1e-4},
            "checkpoint": {"dir": str(tmp_path / "checkpoints")},
            "sync": {"synchronizer_address": sync_address},
        })

        def rollout_config(cid: str) -> dict:
            return {
                "http_port": 0,
                "engine": {"kind": "transformers", "model_path": str(tiny_model),
                           "args": {"dtype": "float32", "max_model_len": 256, "seed": 0}},
                "synchronizer": {"address": sync_address, "component_id": cid, "heartbeat_interval_seconds": 0.5},
            }

        for cid in ("r0", "r1"):
            start(cid, "rollout", rollout_config(cid))
        for name in ("trainer", "r0", "r1"):
            services[name].wait_ready(300)
        r0_port = int(services["r0"].grpc_address.rsplit(":", 1)[1])

        run = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
        run.pop("launch")
        run["launch"] = {"dataset": {"generator": "arithmetic", "train_size": 4 * STEPS, "validation_size": 4}}
        run["run"].update(name="elastic", max_steps=STEPS)
        run.update(mode="fully-async", resume="disable",
                   validation={"before_training": False, "interval": 0},
                   checkpoint={"interval": 0, "at_end": False},
                   services={"synchronizer": {"address": sync_address}, "trainer": {"address": trainer.grpc_address,
                             "timeout_seconds": 600}, "health_interval_seconds": 0.5})
        run["worker"]["max_retries"] = 10
        run_file = tmp_path / "run.yaml"
        run_file.write_text(yaml.safe_dump(run))
        run_dir = tmp_path / "run"
        controller = subprocess.Popen(
            [sys.executable, "-m", "services.controller", "run", str(run_file), "--run-dir", str(run_dir)],
            cwd=ROOT, stdout=open(tmp_path / "controller.out", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        try:
            # 2. A third replica joins mid-run.
            wait_for(lambda: len(ledger(run_dir)) >= 3, 300, "3 steps", controller)
            joined_at = max(e["latest_version"] for e in events(run_dir))  # r2 catches up to this or newer
            start("r2", "rollout", rollout_config("r2"))
            services["r2"].wait_ready(300)
            wait_for(lambda: samples_of(ledger(run_dir), "r2"), 300, "work on r2", controller)
            first_step, first_version = samples_of(ledger(run_dir), "r2")[0]
            assert first_version >= joined_at, "r2 generated before it caught up"

            # 3. r0 dies mid-run.
            services["r0"].process.send_signal(signal.SIGKILL)
            killed_at = len(ledger(run_dir))
            wait_for(lambda: len(ledger(run_dir)) >= killed_at + 2, 300, "2 steps after the kill", controller)

            # 4. r0 restarts on the same address and id.
            restarted_at = max(e["latest_version"] for e in events(run_dir))
            start("r0-again", "rollout", rollout_config("r0"), port=r0_port)
            services["r0-again"].wait_ready(300)
            assert services["r0-again"].grpc_address.endswith(f":{r0_port}")
            back = wait_for(lambda: [s for s in samples_of(ledger(run_dir), "r0") if s[0] > killed_at + 2], 300,
                            "work on r0 after its restart", controller)
            assert min(v for _, v in back) >= restarted_at, "the restarted r0 served its base weights"
            assert controller.wait(600) == 0, (tmp_path / "controller.out").read_text()[-3000:]
        finally:
            if controller.poll() is None:
                controller.kill()
        rows = ledger(run_dir)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        trained = [task for row in rows for task in row["tasks"]]
        assert len(trained) == len(set(trained)) == 4 * STEPS, "a task was lost or trained twice"
        # The synchronizer saw r0 leave and come back.
        r0 = [e["state"] for e in events(run_dir) if e.get("id") == "r0"]
        assert "STOPPED" in r0 and r0[-1] in ("RUNNING", "REQUIRE_SYNC", "STOPPED")
    finally:
        for child in services.values():
            child.stop(grace=5)
