"""An OpenEnv environment server, as its author runs it (examples/openenv/arithmetic: the package's own
HTTP/WebSocket app, in its own virtual environment .venv-openenv, made by `make setup`), drives a run on
real services through the openenv worker: each episode is a WebSocket session, reset then a step a
model turn. With two attempts an episode, the tiny random model's wrong first answer gets the
environment's "Not quite. Try again." and a second turn; the environment then says done. The rewards
trained are the environment's (1 for a right answer: its `accuracy`), and the tokens trained are the
ones the replicas sampled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel.testing.environments import example_environment
from tests.integration.service_processes import Cluster, jsonl, tiny_run

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.mark.timeout(600)
def test_a_run_plays_an_openenv_environment_server_and_trains_on_its_rewards(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    run_dir = tmp_path / "run"
    records = tmp_path / "records.jsonl"
    os.environ["ENVIRONMENT_RECORDS"] = str(records)
    with example_environment(tmp_path / "environment.log", ARITHMETIC_ATTEMPTS="2") as url:
        try:
            _, sync, trainer = cluster.tiny_fleet("rollout-0")
            run = tiny_run("openenv", STEPS, sync, trainer.grpc_address, mode="sync")
            del run["reward"]  # the environment's reward is the reward
            # The openenv worker, writing what the replicas sampled beside what it trained (ENVIRONMENT_RECORDS).
            run["worker"] = {**run["worker"], "type": "tests.integration.environment_records:RecordingEnvironmentWorker",
                             "max_turns": 2, "env": {"url": url, "timeout_seconds": 30}}
            controller = cluster.controller(run, run_dir)
            assert controller.wait(300) == 0, cluster.controller_output()
        finally:
            os.environ.pop("ENVIRONMENT_RECORDS", None)
            cluster.stop()
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
    # What is trained is what the replicas sampled: the model's tokens (mask 1) are each turn's generation,
    # with its log-probs; between them, the environment's observation (mask 0, never trained).
    trained = {task for row in jsonl(run_dir / "trained_tasks.jsonl") for task in row["tasks"]}
    episodes = [r for r in jsonl(records) if r["task"] in trained]
    assert {r["task"] for r in episodes} == trained
    for episode in episodes:
        t, generations = episode["trajectory"], episode["generations"]
        assert t["prompt_ids"] == generations[0]["prompt_token_ids"]
        assert [i for i, m in zip(t["response_ids"], t["response_mask"]) if m] == \
            [i for g in generations for i in g["completion_token_ids"]]
        assert [lp for lp, m in zip(t["response_logprobs"], t["response_mask"]) if m] == \
            pytest.approx([lp for g in generations for lp in g["logprobs"]])
        for g in generations[1:]:  # a later turn generated from everything before it, as trained
            context = g["prompt_token_ids"]
            assert (t["prompt_ids"] + t["response_ids"])[: len(context)] == context
