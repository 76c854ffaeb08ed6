"""A deployed run heals itself: services the launcher did not start die, someone else
(the kubelet) starts them again, and the one controller command catches up and exits 0.

Real processes: a synchronizer, a trainer and a rollout replica (the transformers engine
on the tiny model) started by the test on fixed ports, and the controller driving them
through a `services:` section, as a Kubernetes Job does. The test plays the kubelet: it
SIGKILLs a service after the step-2 checkpoint and starts the same command on the same
ports a moment later (a restarted pod keeps its Service name; a synchronizer without a
store comes back empty, a trainer with its base weights at step 0).

- The synchronizer: the controller notices (it stopped answering, or answers with another
  policy than the run gave it), hands it the run's policy and the trainer's weights, and
  the run goes on: no step is redone.
- The trainer: the run resumes from the last checkpoint. The synchronizer and the replica
  hold versions made by the lost weights: the controller rewinds them to the checkpoint's
  version (the synchronizer's Rewind; the replica installs the version the trainer
  publishes again, although it is lower), and the steps after the checkpoint are redone.
  Nobody restarts anything but the trainer.

Both check summary.json's `restarts` and that the final model's lineage (per step, the
last ledger line) trains every task exactly once. A replica's death needs nothing from
the controller (test_elastic_replicas.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import asyncio

import pytest

from flywheel.synchronizer.client import SynchronizerClient
from tests.conftest import TEST_TOKEN
from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run, wait_for
from flywheel.testing.net import free_port

pytestmark = pytest.mark.slow

STEPS, TASKS_PER_STEP = 8, 4
#: The kubelet's delay before it starts a dead container again (a pod restarts in seconds).
KUBELET_DELAY_SECONDS = 2.0


class Deployment:
    """The three services on fixed ports, each restartable with the same command (a pod)."""

    def __init__(self, root: Path, model: Path) -> None:
        self.cluster = Cluster(root)
        self.model, self.root = model, root
        self.ports = {name: free_port() for name in ("synchronizer", "trainer", "rollout-0")}
        self.sync_address = f"127.0.0.1:{self.ports['synchronizer']}"
        self.configs = {
            # No store (as deployed): a restarted synchronizer knows no component and no version.
            "synchronizer": ("synchronizer", {"checkpoint_root": str(root), "lease_seconds": 3.0,
                                              "sweep_interval_seconds": 0.2}),
            "trainer": ("trainer", {
                "model": {"path": str(model), "cpu_threads": 1},
                "optimizer": {"lr": 1e-4},
                "checkpoint": {"dir": str(root / "checkpoints")},
                "sync": {"synchronizer_address": self.sync_address},
            }),
            "rollout-0": ("rollout", {
                "http_port": 0,
                "engine": {"kind": "transformers", "model_path": str(model),
                           "args": {"dtype": "float32", "max_model_len": 256, "seed": 0}},
                "synchronizer": {"address": self.sync_address, "component_id": "rollout-0",
                                 "heartbeat_interval_seconds": 0.5},
                "updates": {"checkpoint_root": str(root)},
            }),
        }

    def start(self, name: str) -> None:
        kind, config = self.configs[name]
        self.cluster.start(name, kind, config, self.ports[name])

    def start_all(self) -> None:
        self.start("synchronizer")
        self.cluster["synchronizer"].wait_ready(120)
        for name in ("trainer", "rollout-0"):
            self.start(name)
        for name in ("trainer", "rollout-0"):
            self.cluster[name].wait_ready(300)

    def kill_and_restart(self, name: str) -> None:
        """What the kubelet does for a container that died: the same command, same ports, shortly after."""
        process = self.cluster[name].process
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        time.sleep(KUBELET_DELAY_SECONDS)
        self.start(name)

    def run_file(self, name: str, checkpoint_interval: int = 2) -> dict:
        run = tiny_run(name, STEPS, self.sync_address, f"127.0.0.1:{self.ports['trainer']}")
        run.update(resume="auto", checkpoint={"interval": checkpoint_interval, "at_end": True})
        run["launch"].update(ready_timeout_seconds=300, restarts={"backoff_seconds": 1.0})  # tiny_run: free ports
        return run

    def stop(self) -> None:
        self.cluster.stop()


def final_lineage(rows: list[dict]) -> dict[int, list[str]]:
    """Per step, the tasks of its last ledger line: the steps the final model is made of."""
    return {r["step"]: r["tasks"] for r in rows}


def assert_each_task_trained_once(rows: list[dict]) -> None:
    final = final_lineage(rows)
    assert sorted(final) == list(range(1, STEPS + 1)), sorted(final)
    trained = [task for step in sorted(final) for task in final[step]]
    assert len(trained) == len(set(trained)) == STEPS * TASKS_PER_STEP, "a task was trained twice or skipped"


def start_controller(tmp_path: Path, victim: str, checkpoint_interval: int = 2
                     ) -> tuple[Deployment, subprocess.Popen, Path]:
    deployment = Deployment(tmp_path, prepare_tiny_model())
    run_dir = tmp_path / "run"
    try:
        deployment.start_all()
        run = deployment.run_file(f"deployed-{victim}", checkpoint_interval)
        return deployment, deployment.cluster.controller(run, run_dir), run_dir
    except BaseException:
        deployment.stop()
        raise


def synchronizer_status(deployment: Deployment):
    async def ask():
        async with SynchronizerClient(deployment.sync_address, TEST_TOKEN, timeout=10) as client:
            return await client.status()

    return asyncio.run(ask())


def run_output(deployment: Deployment, controller: subprocess.Popen) -> str:
    """The controller's output once it has ended the run, which it must do with exit code 0."""
    code = controller.wait(600)
    output = deployment.cluster.controller_output()
    assert code == 0, output
    return output


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in jsonl(run_dir / "trained_tasks.jsonl")), default=0)


def trainer_killed_after_step_3(tmp_path: Path, checkpoint_interval: int = 2) -> tuple[str, object, Path]:
    """The kubelet restarts the trainer once step 3 is trained; the one controller command heals the
    run and exits 0. Returns its output, the synchronizer's status at the end and the run directory,
    once the run was checked to be healed by the controller alone, every task trained once, in two
    sessions."""
    deployment, controller, run_dir = start_controller(tmp_path, "trainer", checkpoint_interval)
    try:
        wait_for(lambda: trained_steps(run_dir) >= 3, 600, "step 3", controller)
        if checkpoint_interval > STEPS:
            assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
        deployment.kill_and_restart("trainer")
        output = run_output(deployment, controller)
        status = synchronizer_status(deployment)
    finally:
        if controller.poll() is None:
            controller.kill()
        deployment.stop()
    assert "healing: trainer died at step" in output, output
    assert "hold weights newer than step" not in output, "nobody but the kubelet restarts anything"
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    assert_each_task_trained_once(rows)
    assert len({r["session"] for r in rows}) == 2
    return output, status, run_dir


@pytest.mark.timeout(900)
def test_a_synchronizer_restarted_by_the_kubelet_is_caught_up_and_the_run_goes_on(tmp_path: Path) -> None:
    """It comes back empty (no store): the trainer and the replica re-register with their weights, the
    controller hands it the run's policy and the trainer's version again; nothing is redone."""
    deployment, controller, run_dir = start_controller(tmp_path, "synchronizer")
    try:
        wait_for(lambda: trained_steps(run_dir) >= 3, 600, "step 3", controller)
        killed_at = trained_steps(run_dir)
        deployment.kill_and_restart("synchronizer")
        output = run_output(deployment, controller)
    finally:
        if controller.poll() is None:
            controller.kill()
        deployment.stop()
    assert killed_at < STEPS, "the run finished before it could be killed"
    assert "healing: synchronizer died at step" in output, output
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    assert_each_task_trained_once(rows)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step was redone: nothing needed to be"
    [restart] = json.loads((run_dir / "summary.json").read_text())["restarts"]
    assert restart["service"] == "synchronizer" and restart["action"] == "caught up"
    # The restarted synchronizer was handed the run's policy again (its own default is not the run's).
    assert (tmp_path / "synchronizer" / "synchronizer.log").read_text().count("policy configured") == 2


@pytest.mark.timeout(900)
def test_a_trainer_restarted_by_the_kubelet_rewinds_the_run_to_its_last_checkpoint(tmp_path: Path) -> None:
    """It comes back with its base weights: the run resumes from the step-2 checkpoint, the
    controller rewinds the synchronizer and the replica (which hold versions made by the lost
    weights) to version 2, and the later steps are redone. Only the trainer is restarted."""
    output, status, run_dir = trainer_killed_after_step_3(tmp_path)
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    sessions = list(dict.fromkeys(r["session"] for r in rows))
    redone = [r["step"] for r in rows if r["session"] == sessions[1]]
    [restart] = json.loads((run_dir / "summary.json").read_text())["restarts"]
    assert restart["service"] == "trainer" and restart["action"] == "resumed"
    assert Path(restart["resumed_from"]).name == f"global_step_{redone[0] - 1}"
    assert restart["rewound_to"] == redone[0] - 1
    assert f"rewound the synchronizer and the replicas to version {redone[0] - 1}" in output, output
    assert redone == list(range(restart["redo_from_step"], STEPS + 1))
    # One lineage since the rewind, and the replica followed it to the end. batch-async with staleness
    # threshold 1: step r's rollouts are made while step r - 1 trains, on version r - 2 or r - 1, and
    # the sync to version STEPS - 1 may still be in flight when the controller exits.
    assert (status.epoch, status.rewound_to, status.latest_version) == (1, redone[0] - 1, STEPS)
    [replica] = [c for c in status.components if c.id == "rollout-0"]
    assert replica.weight_version in (STEPS - 2, STEPS - 1), status.describe()
    last_versions = [start for start, _ in rows[-1]["sample_versions"]]
    assert min(last_versions) >= STEPS - 2, last_versions
    # A version is an identity, not a number: every update the replica verified in the new lineage
    # carries the new lineage's identity of its version, and the replica ends holding it. (Whether the
    # redone steps' bytes differ from the abandoned ones depends on the run: here every reward is 0 on
    # the random model, so the redone steps make the very same weights, and the same identities; a
    # changed byte gives another identity: tests/unit/codec/test_codec_identity.py.)
    events = jsonl(run_dir / "synchronizer_events.jsonl")
    committed: dict[tuple[int, int], str] = {}
    for e in events:
        if e["kind"] == "VERSION_COMMITTED" and e.get("identity"):
            committed.setdefault((e["epoch"], e["version"]), e["identity"])
    current = {v: i for (epoch, v), i in committed.items() if epoch == 1}
    assert current, committed
    verified = [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED" and e["epoch"] == 1
                and e["update"]["outcome"] == "VERIFIED" and e["update"]["version"] in current]
    assert verified and all(u["identity"] == current[u["version"]] for u in verified), verified
    assert replica.weight_identity.hex() == current[replica.weight_version] or replica.weight_version not in current


@pytest.mark.timeout(900)
def test_a_trainer_that_dies_before_its_first_checkpoint_starts_the_run_over(tmp_path: Path) -> None:
    """No checkpoint yet (every STEPS * 10 steps): the trainer comes back on the base model, and the
    run resumes at step 0. The synchronizer and the replica hold versions made by the lost weights:
    the controller starts them over (Rewind to version 0: every version dropped, the replica reloads
    the weights it started with), and every step is redone. Only the trainer is restarted."""
    output, status, run_dir = trainer_killed_after_step_3(tmp_path, checkpoint_interval=STEPS * 10)
    assert "rewound the synchronizer and the replicas to version 0" in output, output
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    sessions = list(dict.fromkeys(r["session"] for r in rows))
    assert [r["step"] for r in rows if r["session"] == sessions[1]] == list(range(1, STEPS + 1))
    [restart] = json.loads((run_dir / "summary.json").read_text())["restarts"]
    assert (restart["service"], restart["action"], restart["rewound_to"], restart["redo_from_step"]) == (
        "trainer", "resumed", 0, 1)
    assert (status.epoch, status.rewound_to, status.latest_version) == (1, 0, STEPS)
    # The replica went back to its base weights (version 0 of the new lineage), then on. No publisher
    # recorded the base model's identity, so that reload is UNVERIFIED, never VERIFIED (nothing to judge it
    # against: services/synchronizer/updates.py); the replica is not quarantined for it, and every version
    # the new trainer made is proven on it.
    events = jsonl(run_dir / "synchronizer_events.jsonl")
    updates = [e["update"] for e in events if e["kind"] == "UPDATE_REPORTED" and e["epoch"] == 1]
    back = [u for u in updates if u["version"] == 0]
    assert back and back[0]["outcome"] == "UNVERIFIED", back
    # (the last step's version ends the run: no replica needs it)
    assert {u["version"] for u in updates if u["outcome"] == "VERIFIED"} == set(range(1, STEPS)), updates


@pytest.mark.timeout(900)
def test_with_restarts_off_the_jobs_next_pod_resumes_the_run_once_nothing_holds_lost_weights(tmp_path: Path) -> None:
    """`launch.restarts.max_restarts: 0`: the trainer's death ends the controller (exit 1), and the
    Job starts it again. The new one resumes from the last checkpoint and, before anything is
    generated, rewinds the synchronizer and the replica, which hold the lost weights' versions."""
    deployment = Deployment(tmp_path, prepare_tiny_model())
    run_dir = tmp_path / "run"
    run = deployment.run_file("deployed-job")
    run["launch"]["restarts"] = {"max_restarts": 0}
    try:
        deployment.start_all()
        controller = deployment.cluster.controller(run, run_dir)
        try:
            wait_for(lambda: trained_steps(run_dir) >= 3, 600, "step 3", controller)
            deployment.kill_and_restart("trainer")
            assert controller.wait(300) == 1, deployment.cluster.controller_output()
            assert "healing" not in deployment.cluster.controller_output()
            controller = deployment.cluster.controller(run, run_dir)  # the Job's next pod
            output = run_output(deployment, controller)
        finally:
            if controller.poll() is None:
                controller.kill()
    finally:
        deployment.stop()
    assert "healing: rewound the synchronizer and the replicas to version" in output, output
    rows = jsonl(run_dir / "trained_tasks.jsonl")
    assert_each_task_trained_once(rows)
    assert len({r["session"] for r in rows}) == 2
