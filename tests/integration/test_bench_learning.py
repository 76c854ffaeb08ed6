"""bench/learning.py's smoke mode runs (our trainer step beside the plain-torch floor, on a tiny
model) and names the machine its figures come from: a bench that CI runs does not rot unseen."""

from __future__ import annotations


import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_the_learning_bench_smoke_reports_the_trainer_against_its_floor_and_the_cpu() -> None:
    result = run_smoke("learning", 550)
    assert result["trainer_step_seconds"] > 0 and result["torch_floor_step_seconds"] > 0
    assert result["trainer_step_vs_torch_floor"] == pytest.approx(
        result["trainer_step_seconds"] / result["torch_floor_step_seconds"], abs=0.01)
    assert result["cpu_model"] and result["cpu_isa"] in ("amx", "avx512_bf16", "avx512", "avx2", "other")
    assert result["cpu_cores"] >= 1
