"""bench/trl_grpo.py's smoke mode runs both sides of the comparison (our quickstart job and TRL's
GRPOTrainer on the same data, the tiny model, two steps) and reports both, training and validation
times apart, with the seed and the CPU: the baseline we publish against does not rot unseen."""

from __future__ import annotations


import pytest

from flywheel.models.precision import native_bfloat16
from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_trl_bench_smoke_reports_both_sides() -> None:
    result = run_smoke("trl_grpo", 850, "--seed", "1")
    assert result["bench"] == "trl_grpo" and result["steps"] == 2 and result["seed"] == 1
    assert result["flywheel_seconds_per_step"] > 0 and result["trl_seconds_per_step"] > 0
    assert result["flywheel_step_vs_trl_step"] == pytest.approx(
        result["trl_seconds_per_step"] / result["flywheel_seconds_per_step"], rel=0.01)
    for side in ("flywheel", "trl"):
        assert 0 <= result[f"{side}_val_before"] <= 1 and 0 <= result[f"{side}_val_after"] <= 1
        # Training and validation apart, each inside the side's wall time.
        train, validation = result[f"{side}_train_seconds"], result[f"{side}_validation_seconds"]
        assert train > 0 and validation > 0
        assert train + validation <= result[f"{side}_seconds_per_step"] * result["steps"] + 0.5
        assert len(result[f"{side}_rewards"]) == 2
    # The ratio of the unrounded times; the times are printed to 0.1 s (a smoke's are a few seconds).
    trl, ours = result["trl_train_seconds"], result["flywheel_train_seconds"]
    assert (trl - 0.05) / (ours + 0.05) - 0.001 <= result["flywheel_train_step_vs_trl_train_step"] \
        <= (trl + 0.05) / (ours - 0.05) + 0.001
    assert 0 <= result["flywheel_val_after_hf"] <= 1  # our final weights through TRL's side's evaluator
    assert result["cpu_model"] and result["cpu_isa"]
    # TRL's bf16 autocast only where the CPU computes bfloat16 natively, as our side's autocast: auto.
    assert result["trl_bf16"] is native_bfloat16("cpu")
