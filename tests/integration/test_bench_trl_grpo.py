"""bench/trl_grpo.py's smoke mode runs both sides of the comparison (our quickstart job and TRL's
GRPOTrainer on the same data, the tiny model, two steps) and reports both, with the CPU: the
baseline we publish against does not rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_trl_bench_smoke_reports_both_sides() -> None:
    proc = subprocess.run([sys.executable, "bench/trl_grpo.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=850, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "trl_grpo" and result["steps"] == 2
    assert result["flywheel_seconds_per_step"] > 0 and result["trl_seconds_per_step"] > 0
    assert result["flywheel_step_vs_trl_step"] == pytest.approx(
        result["trl_seconds_per_step"] / result["flywheel_seconds_per_step"], rel=0.01)
    for side in ("flywheel", "trl"):
        assert 0 <= result[f"{side}_val_before"] <= 1 and 0 <= result[f"{side}_val_after"] <= 1
    assert result["cpu_model"] and result["cpu_isa"]
