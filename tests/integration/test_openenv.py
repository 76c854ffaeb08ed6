"""An OpenEnv environment server, as its author runs it (examples/openenv/arithmetic: the package's own
HTTP/WebSocket app, in its own virtual environment .venv-openenv, made by `make setup`), drives a run on
real services through the openenv worker: each episode is a WebSocket session, reset then a step a
model turn. With two attempts an episode, the tiny random model's wrong first answer gets the
environment's "Not quite. Try again." and a second turn; the environment then says done. The rewards
trained are the environment's (1 for a right answer: its `accuracy`)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run
from tests.net import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
EXAMPLE = ROOT / "examples" / "openenv" / "arithmetic"
STEPS = 3


def start_environment(port: int, log: Path, **env: str) -> subprocess.Popen:
    assert ENV_PYTHON.exists(), f"{ENV_PYTHON} is missing: `make setup` makes it (requirements/openenv.txt)"
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    server = subprocess.Popen(
        [str(ENV_PYTHON), "-m", "uvicorn", "server.app:app", "--app-dir", str(EXAMPLE), "--host", "127.0.0.1",
         "--port", str(port)], cwd=EXAMPLE, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the environment server exited:\n{log.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise AssertionError(f"the environment server did not listen in 60 s:\n{log.read_text()[-2000:]}")


@pytest.mark.timeout(600)
def test_a_run_plays_an_openenv_environment_server_and_trains_on_its_rewards(tmp_path: Path) -> None:
    model = prepare_tiny_model()
    port = free_port()
    server = start_environment(port, tmp_path / "environment.log", ARITHMETIC_ATTEMPTS="2")
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    try:
        sync = cluster.synchronizer()
        trainer = cluster.trainer(model, sync)
        cluster.rollout("rollout-0", model, sync)
        for name in ("trainer", "rollout-0"):
            cluster[name].wait_ready(300)
        run = tiny_run("openenv", STEPS, sync, trainer.grpc_address, mode="sync")
        del run["reward"]  # the environment's reward is the reward
        run["worker"] = {**run["worker"], "type": "openenv", "max_turns": 2,
                         "env": {"url": f"http://127.0.0.1:{port}", "timeout_seconds": 30}}
        controller = cluster.controller(run, run_dir)
        assert controller.wait(300) == 0, cluster.controller_output()
    finally:
        cluster.stop()
        server.terminate()
        server.wait(30)
    steps = [m for m in jsonl(run_dir / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(steps) == STEPS, cluster.controller_output()
    for m in steps:
        # Every episode ended by the environment's word: right at once (1 turn) or after its second attempt.
        assert m["rollout/env_done_mean"] == 1.0, m
        assert 1.0 <= m["rollout/env_turns_mean"] <= 2.0, m
        # The reward trained is the environment's: 1 exactly when it judged the answer right.
        assert m["rollout/reward_mean"] == pytest.approx(m["rollout/accuracy_mean"]), m
    # The tiny random model answers wrong: the environment's second attempt was played.
    assert any(m["rollout/env_turns_mean"] > 1.0 for m in steps), steps
    sessions = (tmp_path / "environment.log").read_text().count('"WebSocket /ws" [accepted]')
    assert sessions >= STEPS * 16, sessions  # a session an episode: 16 samples a step
    assert len(jsonl(run_dir / "trained_tasks.jsonl")) == STEPS
