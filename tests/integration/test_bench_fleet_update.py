"""bench/fleet_update.py's smoke mode runs end to end with real services and reports every phase
of an update: a bench that CI runs does not rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_fleet_update_bench_smoke_reports_every_phase() -> None:
    proc = subprocess.run([sys.executable, "bench/fleet_update.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=850, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "fleet_update"
    for phase in ("transfer", "admit", "apply", "verify", "reopen", "pause"):
        assert result[f"tiny_{phase}_seconds"] >= 0
    assert result["tiny_transfer_seconds"] > 0 and result["tiny_verify_seconds"] > 0
    # The pause covers admit, apply, verify and reopen (medians, so within rounding of their sum).
    assert result["tiny_pause_seconds"] > 0 and result["pause_vs_transfer"] == result["tiny_pause_vs_transfer"]
