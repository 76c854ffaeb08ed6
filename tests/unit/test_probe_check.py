"""flywheel.probe.check: which difference a replica's probe is held to."""

from __future__ import annotations

import math

import pytest

from flywheel.probe import PROBE_LENGTH, PROBE_SEQUENCES, ProbeBatch, ProbeStatistic, ProbeTolerance, check, probe_sequences

IDS = probe_sequences(1000)
TRAINER = ProbeBatch.of(IDS, [[-float(i + 1) for i in range(PROBE_LENGTH - 1)] for _ in IDS])


def replica(diffs: list[float]) -> list[list[float]]:
    """The replica's scores: the trainer's moved by `diffs` (row-major over the batch's tokens)."""
    flat = iter(diffs)
    return [[lp + next(flat) for lp in row] for row in TRAINER.logprobs]


def rounded_like_bfloat16() -> list[float]:
    """Correct weights served in bfloat16, as measured on SmolLM2 (docs/verification.md): most tokens
    within 0.1 nats, a few far out (a near-tie of large logits rounded apart)."""
    diffs = [0.02 + 0.1 * ((7 * i) % 11) / 10 for i in range(TRAINER.tokens)]
    diffs[2], diffs[20] = 6.85, 2.6
    return diffs


def test_the_batch_compares_sixty_tokens() -> None:
    assert TRAINER.tokens == PROBE_SEQUENCES * (PROBE_LENGTH - 1) == 60


def test_the_largest_difference_fails_a_heavy_tail_the_median_passes() -> None:
    measured = replica(rounded_like_bfloat16())
    by_max = check(TRAINER, measured, ProbeTolerance(0.5))
    by_median = check(TRAINER, measured, ProbeTolerance(0.25, ProbeStatistic.MEDIAN))
    assert not by_max.passed and math.isclose(by_max.max_abs_diff, 6.85) and by_max.worst == (0, 2)
    assert by_median.passed and by_median.median_abs_diff < 0.15 and by_median.held == by_median.median_abs_diff
    assert by_max.max_abs_diff == by_median.max_abs_diff and by_max.mean_abs_diff == by_median.mean_abs_diff


def test_a_median_check_fails_when_most_tokens_move() -> None:
    # Two same-shaped layers swapped: the median of SmolLM2's 60 tokens moved to 1.10 nats and more.
    swapped = [d + 0.5 for d in rounded_like_bfloat16()]
    result = check(TRAINER, replica(swapped), ProbeTolerance(0.25, ProbeStatistic.MEDIAN))
    assert not result.passed and result.median_abs_diff > 0.5 and "FAILED" in result.describe()


def test_a_nan_at_any_token_never_passes_either_statistic() -> None:
    diffs = [0.0] * TRAINER.tokens
    diffs[5] = float("nan")
    assert not check(TRAINER, replica(diffs), ProbeTolerance(1.0)).passed
    by_median = check(TRAINER, replica(diffs), ProbeTolerance(1.0, ProbeStatistic.MEDIAN))
    assert by_median.median_abs_diff == 0.0 and not by_median.passed


def test_a_tolerance_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0 nats"):
        ProbeTolerance(0.0)
