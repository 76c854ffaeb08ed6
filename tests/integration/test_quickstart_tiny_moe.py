"""The quickstart's shape on the tiny mixture-of-experts model, routing replay on, with real processes:
`python -m services.controller run examples/quickstart-tiny-moe.yaml` (a tiny Qwen3-MoE, the rollout on
the transformers engine in float32, which records each token's routing; the trainer in bfloat16
autocast replaying it) completes its steps, every weight version reaching the rollout, and each step's
metrics report the routing decisions the trainer's routers would have made otherwise."""

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
CONFIG = ROOT / "examples" / "quickstart-tiny-moe.yaml"


@pytest.mark.timeout(600)
def test_the_tiny_moe_quickstart_trains_with_routing_replay(tmp_path: Path) -> None:
    steps = yaml.safe_load(CONFIG.read_text())["run"]["max_steps"]
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLYWHEEL_MODEL_CACHE": str(tmp_path / "models"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "services.controller", "run", str(CONFIG), "--run-dir", str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"reached run.max_steps = {steps}" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in rows if "train/routing_decisions" in m]
    assert [m["step"] for m in trained] == [float(s) for s in range(1, steps + 1)]
    for m in trained:
        assert m["train/routing_decisions"] > 0
        assert 0 <= m["train/routing_flip_fraction"] < 0.05
    # Every version the trainer published was served: the last step trained samples of the version before it.
    assert trained[-1]["version"] == steps and trained[-1]["staleness/token_age_max"] <= 1
    trainer_config = yaml.safe_load((run_dir / "trainer.yaml").read_text())
    assert trainer_config["model"]["routing_replay"] is True and trainer_config["model"]["autocast"] == "bfloat16"
