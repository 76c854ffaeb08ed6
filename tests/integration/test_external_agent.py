"""An unmodified agent (the `openai` SDK only) trained through real services.

The tiny quickstart (synchronizer, trainer and rollout processes, MEMORY
weights, fully-async) with `worker.type` the external worker: every episode
is a session on the rollout, and the agent (tests/integration/external_agents.py)
holds a three-turn conversation through it, pausing between turns; every
fourth task's agent raises after its first call.

What must hold:
- what is trained is what the session recorded: for every trained sample,
  prompt + response ids are the last call's prompt + completion ids, the
  loss mask covers exactly the completions' ids, with their log-probs, and
  each turn extends the one before (the rollout spliced the conversation:
  one segment, nothing dropped);
- an agent that raises is counted and its task never trained;
- the per-turn versions are each call's versions, and a weight update in the
  middle of an episode shows in them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("external-agent")
    config = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    config["run"].update(name="external-agent", max_steps=STEPS)
    config["launch"]["dataset"]["train_size"] = 8 * STEPS  # a quarter of the tasks fail: room to spare
    config.update(
        mode="fully-async", resume="disable", sync={"method": "memory", "interval": 1},
        validation={"before_training": False, "interval": 0}, checkpoint={"interval": 0, "at_end": False},
        worker={
            "type": "tests.integration.external_agents:RecordingWorker",
            "agent": "tests/integration/external_agents.py:run",
            "group_size": 4, "max_in_flight": 4, "agent_timeout_seconds": 120, "max_retries": 1,
        },
    )
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = root / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EXTERNAL_AGENT_RECORDS": str(root / "records.jsonl"),
           "EXTERNAL_AGENT_PAUSE": "0.5", "FLYWHEEL_MODEL_CACHE": str(root / "models")}
    proc = subprocess.run(
        [sys.executable, "-m", "services.controller", "run", str(path), "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (run_dir / "records.jsonl").write_text((root / "records.jsonl").read_text())
    return run_dir


def trained_episodes(run_dir: Path) -> list[dict]:
    """The recorded episodes of the tasks the ledger says were trained."""
    trained = {task for row in jsonl(run_dir / "trained_tasks.jsonl") for task in row["tasks"]}
    episodes = [r for r in jsonl(run_dir / "records.jsonl") if r["task"] in trained and r["status"] == "success"]
    assert trained and {r["task"] for r in episodes} == trained
    return episodes


@pytest.mark.timeout(1000)
def test_the_trained_tokens_are_the_session_records(run_dir: Path) -> None:
    for episode in trained_episodes(run_dir):
        calls, t = episode["calls"], episode["trajectory"]
        assert len(calls) == 3, "three calls, one segment"
        for before, after in zip(calls, calls[1:]):
            context = before["prompt_token_ids"] + before["completion_token_ids"]
            assert after["prompt_token_ids"][: len(context)] == context, "a turn did not extend the previous one"
        last = calls[-1]
        assert t["prompt_ids"] + t["response_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
        assert t["prompt_ids"] == calls[0]["prompt_token_ids"]
        trained = [i for i, m in zip(t["response_ids"], t["response_mask"]) if m]
        assert trained == [i for c in calls for i in c["completion_token_ids"]]
        logprobs = [lp for lp, m in zip(t["response_logprobs"], t["response_mask"]) if m]
        assert logprobs == pytest.approx([lp for c in calls for lp in c["completion_logprobs"]])
        assert all(lp == 0.0 for lp, m in zip(t["response_logprobs"], t["response_mask"]) if not m)
        assert [tuple(v) for v in t["turn_versions"]] == [(c["version_start"], c["version_end"]) for c in calls]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["worker"].get("dropped_segments", 0) == 0


@pytest.mark.timeout(1000)
def test_an_agent_that_raises_is_counted_and_never_trained(run_dir: Path) -> None:
    records = jsonl(run_dir / "records.jsonl")
    broken = {r["task"] for r in records if r["status"] == "fail"}
    assert broken and all(int(task.rsplit(":", 1)[-1]) % 4 == 3 for task in broken)
    assert all("the agent raised RuntimeError" in r["error"] for r in records if r["status"] == "fail")
    trained = {task for row in jsonl(run_dir / "trained_tasks.jsonl") for task in row["tasks"]}
    assert not broken & trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["worker"]["agent_errors"] >= len(broken)


@pytest.mark.timeout(1000)
def test_a_weight_update_mid_episode_shows_in_the_turn_versions(run_dir: Path) -> None:
    ledger = jsonl(run_dir / "trained_tasks.jsonl")
    turn_versions = [[tuple(v) for v in sample] for row in ledger for sample in row["sample_turn_versions"]]
    assert all(len(sample) == 3 for sample in turn_versions)
    for row in ledger:
        for sample, (start, end) in zip(row["sample_turn_versions"], row["sample_versions"]):
            # The sample's versions span its turns', and staleness counts from the oldest turn.
            assert start == min(s for s, _ in sample) and end == max(e for _, e in sample)
            assert all(s <= e for s, e in sample) and start <= end <= row["trained_version"]
    assert any(len({v for turn in sample for v in turn}) > 1 for sample in turn_versions), (
        "no episode saw the weights move between its turns", turn_versions)
