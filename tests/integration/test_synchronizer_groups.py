"""NCCL method on CPUs: a gloo group between a trainer process and two rollout
processes, set up by a real synchronizer, moving real tensors bit-exact; a
receiver failing mid-broadcast leaves everyone on the old version and the
next sync goes through."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from tests.conftest import TEST_TOKEN
from tests.integration.test_synchronizer_participant import digest, weights

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.integration.test_synchronizer_participant"


async def start(*args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", MODULE, *args, cwd=ROOT, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )


async def records(process: asyncio.subprocess.Process, timeout: float = 120) -> list[dict]:
    out, _ = await asyncio.wait_for(process.communicate(), timeout)
    text = out.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def wait_ready(process: asyncio.subprocess.Process) -> str:
    while True:
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        assert line, "participant exited before it was ready"
        if line.startswith(b"{"):
            return json.loads(line)["ready"]


async def test_gloo_group_moves_weights_bit_exact_and_survives_a_failed_receiver() -> None:
    # Rendezvous ports away from the defaults other tests may be using.
    ports = {"rendezvous_port_min": 41000 + os.getpid() % 1000 * 10, "rendezvous_port_max": 41009 + os.getpid() % 1000 * 10}
    async with embedded_synchronizer(server={"auth_token": TEST_TOKEN}, **ports) as server:
        async with SynchronizerClient(server.address, token=TEST_TOKEN) as ctl:
            await ctl.configure_policy("fixed", "nccl", 1)
            a = await start("rollout", server.address, "--id", "rollout-a", "--versions", "3")
            b = await start("rollout", server.address, "--id", "rollout-b", "--versions", "3",
                            "--fail-version", "2", "--fail-bucket", "1")
            trainer = await start("trainer", server.address, "--id", "trainer", "--versions", "3",
                                  "--rollouts", "rollout-a", "rollout-b")
            ready = await asyncio.gather(wait_ready(a), wait_ready(b), wait_ready(trainer))
            assert ready == ["rollout-a", "rollout-b", "trainer"]
            trainer.stdin.write(b"go\n")
            await trainer.stdin.drain()
            got_t, got_a, got_b = await asyncio.gather(records(trainer), records(a), records(b))
            status = await ctl.status()

    got_t = [r for r in got_t if "version" in r]
    assert [(r["version"], r["state"]) for r in got_t] == [(1, "COMMITTED"), (2, "ABORTED"), (3, "COMMITTED")]
    # Whoever reports first names the cause: rollout-b's injected error, or the
    # broken connection it left behind on the trainer's side.
    assert "rollout-b failed: RuntimeError: injected failure" in got_t[1]["error"] or (
        "trainer failed" in got_t[1]["error"] or "rollout-a failed" in got_t[1]["error"]
    )
    v1, v3 = digest(weights(1)), digest(weights(3))
    for got in (got_a, got_b):
        rows = [r for r in got if "version" in r]
        assert [(r["version"], r["state"], r["applied"]) for r in rows] == [
            (1, "COMMITTED", True), (2, "ABORTED", False), (3, "COMMITTED", True),
        ]
        # bit-exact after each commit; the aborted version 2 left version 1 in place
        assert [r["live"] for r in rows] == [v1, v1, v3]
    # Each participant deregistered as it exited.
    assert {c.id: (c.state.name, c.weight_version) for c in status.components} == {
        "trainer": ("STOPPED", 0), "rollout-a": ("STOPPED", 3), "rollout-b": ("STOPPED", 3),
    }
    assert status.latest_version == 3
    assert [t.state.name for t in status.transfers] == ["COMMITTED", "ABORTED", "COMMITTED"]
