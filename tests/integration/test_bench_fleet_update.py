"""bench/fleet_update.py's smoke mode runs end to end with real services and reports every phase
of an update: a bench that CI runs does not rot unseen."""

from __future__ import annotations


import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_fleet_update_bench_smoke_reports_every_phase() -> None:
    result = run_smoke("fleet_update", 850)
    assert result["bench"] == "fleet_update"
    for phase in ("transfer", "admit", "apply", "verify", "reopen", "pause"):
        assert result[f"tiny_{phase}_seconds"] >= 0
    assert result["tiny_transfer_seconds"] > 0 and result["tiny_verify_seconds"] > 0
    # The pause covers admit, apply, verify and reopen (medians, so within rounding of their sum).
    assert result["tiny_pause_seconds"] > 0 and result["pause_vs_transfer"] == result["tiny_pause_vs_transfer"]
