"""The controller against real synchronizer, trainer and rollout processes, per mode.

Each mode runs the tiny quickstart (real gRPC services, vLLM CPU or the
transformers engine, real torch training, MEMORY weight sync through the
synchronizer) for a few GRPO steps, then reads the run's ledger: for every
trained sample, the weight versions that generated it (first and last token)
beside the version the step trained. The mode's promise must hold:

- sync: every sample comes from exactly the weights being trained (on-policy);
- batch-async, threshold 1: no sample is more than 1 version behind;
- fully-async: no bound, but no sample is from weights newer than the
  trainer's, and generation does follow the trainer (later steps train on
  samples from versions past 0).
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


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def run_mode(tmp_path: Path, cache: Path, mode: str) -> list[dict]:
    config = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    config["run"].update(name=f"modes-{mode}", max_steps=STEPS)
    config["mode"] = mode
    config["staleness"] = {"threshold": 1, "policy": "drop"}
    config["validation"] = {"before_training": False, "interval": 0}
    config["checkpoint"] = {"interval": 0, "at_end": False}
    config["resume"] = "disable"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLYWHEEL_MODEL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.controller", "run", str(path), "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "trained_tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        # Each step trains the version its predecessor produced.
        assert row["trained_version"] == row["step"] - 1
        assert len(row["sample_versions"]) == 16  # 4 questions x 4 samples
        assert all(start <= end <= row["trained_version"] for start, end in row["sample_versions"])
    return rows


@pytest.mark.timeout(1000)
def test_sync_mode_trains_only_on_policy_samples(tmp_path: Path, model_cache: Path) -> None:
    for row in run_mode(tmp_path, model_cache, "sync"):
        assert {tuple(v) for v in row["sample_versions"]} == {(row["trained_version"],) * 2}, row


@pytest.mark.timeout(1000)
def test_batch_async_keeps_every_sample_within_the_threshold(tmp_path: Path, model_cache: Path) -> None:
    rows = run_mode(tmp_path, model_cache, "batch-async")
    for row in rows:
        assert all(row["trained_version"] - start <= 1 for start, _ in row["sample_versions"]), row
    # The rollout did move: the last step's samples are not from the base weights.
    assert min(start for start, _ in rows[-1]["sample_versions"]) >= STEPS - 2


@pytest.mark.timeout(1000)
def test_fully_async_follows_the_trainer_without_a_bound(tmp_path: Path, model_cache: Path) -> None:
    rows = run_mode(tmp_path, model_cache, "fully-async")
    assert max(end for row in rows for _, end in row["sample_versions"]) >= 1, "weights never reached the rollout"
