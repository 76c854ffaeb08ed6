"""A verifiers environment (examples/verifiers/flywheel_arithmetic, a taskset as its author writes one for
verifiers 0.4) drives a run on real services through the verifiers worker: the controller starts the
verifiers host in verifiers' own virtual environment (.venv-verifiers, made by `make setup`), and each
episode is verifiers' own `null` harness (its chat program, run by uv in verifiers' subprocess runtime)
calling the rollout's session as its OpenAI endpoint.

What must hold: the rewards trained are the taskset's (its `accuracy` reward), what is trained is
exactly what the session recorded (prompt, the sampled tokens and their log-probs), and a run whose
environment cannot load stops with verifiers' own error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel.errors import FailedPrecondition
from services.controller.adapters.verifiers_env import VerifiersHost
from services.controller.run_config import VerifiersConfig
from tests.integration.service_processes import ROOT, Cluster, jsonl, tiny_run

pytestmark = pytest.mark.slow

STEPS = 2
#: A taskset of the test's (tests/integration/verifiers_tasksets/reply_parity): its reward, 1 for a reply of an
#: even length, is one the tiny random model earns half the time, and the test recomputes from the records.
VERIFIERS = {"taskset": "reply-parity", "path": [str(ROOT / "tests" / "integration" / "verifiers_tasksets")],
             "python": str(ROOT / ".venv-verifiers" / "bin" / "python")}


def verifiers_run(name: str, sync: str, trainer: str, **verifiers: object) -> dict:
    run = tiny_run(name, STEPS, sync, trainer, mode="sync")
    del run["reward"]  # the taskset's reward is the reward
    worker = {k: v for k, v in run["worker"].items() if k not in ("instruction", "system_prompt")}
    run["worker"] = {**worker, "type": "tests.integration.external_agents:RecordingVerifiersWorker",
                     "verifiers": {**VERIFIERS, **verifiers}, "agent_timeout_seconds": 240, "timeout_seconds": 400}
    return run


@pytest.mark.timeout(900)
def test_a_run_plays_a_verifiers_environment_and_trains_what_its_sessions_recorded(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    records = tmp_path / "records.jsonl"
    os.environ["EXTERNAL_AGENT_RECORDS"] = str(records)
    try:
        _, sync, trainer = cluster.tiny_fleet("rollout-0")
        controller = cluster.controller(verifiers_run("verifiers", sync, trainer.grpc_address), run_dir)
        assert controller.wait(600) == 0, cluster.controller_output()
    finally:
        os.environ.pop("EXTERNAL_AGENT_RECORDS", None)
        cluster.stop()
    log = (run_dir / "controller.log").read_text()
    assert "verifiers host http://127.0.0.1:" in log and "taskset reply-parity" in log, log[-3000:]
    steps = [m for m in jsonl(run_dir / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(steps) == STEPS, cluster.controller_output()
    trained = {task for row in jsonl(run_dir / "trained_tasks.jsonl") for task in row["tasks"]}
    episodes = [r for r in jsonl(records) if r["task"] in trained and r["status"] == "success"]
    assert trained and {r["task"] for r in episodes} == trained
    for episode in episodes:
        (call,), t = episode["calls"], episode["trajectory"]  # one call: the chat program's one turn
        # What is trained is what the session recorded: the prompt, the sampled tokens, their log-probs.
        assert t["prompt_ids"] == call["prompt_token_ids"]
        assert t["response_ids"] == call["completion_token_ids"] and all(t["response_mask"])
        assert t["response_logprobs"] == pytest.approx(call["completion_logprobs"])
        # The reward is the taskset's, on the reply the model made (verifiers' `last_reply` is stripped).
        reply = call["text"].strip()
        assert t["reward"] == float(len(reply) % 2 == 0), (t, reply)
        assert t["scores"]["even"] == t["reward"] and t["scores"]["env_reply_chars"] == len(reply)
        assert t["scores"]["env_turns"] == 1.0
    rewards = [e["trajectory"]["reward"] for e in episodes]
    assert 0.0 in rewards and 1.0 in rewards, rewards  # both kinds were trained: the groups had an advantage


@pytest.mark.timeout(300)
async def test_a_taskset_that_cannot_load_stops_the_host_with_its_error() -> None:
    host = VerifiersHost(VerifiersConfig(**{**VERIFIERS, "taskset": "no-such-taskset"}))
    with pytest.raises(FailedPrecondition) as refused:
        await host.start()
    assert "the verifiers host ended before it served" in str(refused.value)
    assert "taskset 'no-such-taskset' not found" in str(refused.value)  # verifiers' own words
