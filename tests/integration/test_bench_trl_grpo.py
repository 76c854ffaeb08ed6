"""bench/trl_grpo.py's smoke mode runs both sides of the comparison (our quickstart job and TRL's
GRPOTrainer on the same data, the tiny model, two steps) and reports both, with the CPU: the
baseline we publish against does not rot unseen."""

from __future__ import annotations


import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_trl_bench_smoke_reports_both_sides() -> None:
    result = run_smoke("trl_grpo", 850)
    assert result["bench"] == "trl_grpo" and result["steps"] == 2
    assert result["flywheel_seconds_per_step"] > 0 and result["trl_seconds_per_step"] > 0
    assert result["flywheel_step_vs_trl_step"] == pytest.approx(
        result["trl_seconds_per_step"] / result["flywheel_seconds_per_step"], rel=0.01)
    for side in ("flywheel", "trl"):
        assert 0 <= result[f"{side}_val_before"] <= 1 and 0 <= result[f"{side}_val_after"] <= 1
    assert result["cpu_model"] and result["cpu_isa"]
