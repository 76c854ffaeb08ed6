"""bench/deltas.py's smoke mode runs the tiny quickstart with a checkpoint a step and reports what a delta
carries of each version, in float32 and bfloat16: a bench that CI runs does not rot unseen."""

from __future__ import annotations


import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_delta_bench_smoke_measures_real_consecutive_versions() -> None:
    result = run_smoke("deltas", 850)
    assert result["versions"] == 3 and result["cpu_model"]
    for dtype in ("fp32", "bf16"):
        # Every step changed the model (a delta of nothing would be a bench of nothing), and the delta
        # never costs more than the full version plus a byte a tensor.
        assert 0 < result[f"delta_fraction_{dtype}"] < 1.01
        assert result[f"delta_vs_full_{dtype}"] == pytest.approx(1 / result[f"delta_fraction_{dtype}"], rel=0.02)
    # Rounding to bfloat16 hides most of a small step: its delta is the smaller share of its version.
    assert result["delta_fraction_bf16"] < result["delta_fraction_fp32"]
