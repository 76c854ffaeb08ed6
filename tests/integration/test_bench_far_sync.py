"""bench/far_sync.py --smoke: a version reaches a far replica over the emulated link in every way the
bench measures (raw TCP, full pull, delta pull, a pull reset half-way that resumes, four replicas
behind a relay), each pulled version bit-exact (the bench refuses otherwise), and it ends with its
ratios."""

from __future__ import annotations

import pytest

from flywheel.testing.link_emulator import available
from tests.integration.bench_smoke import run_smoke

WHY_NOT = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")]

@pytest.mark.timeout(600)
def test_far_sync_smoke_measures_every_road_and_ends_with_its_ratios() -> None:
    result = run_smoke("far_sync", 580)
    for ratio in ("delta_vs_full_tcp", "resume_bytes_vs_one_copy", "relay_last_vs_one", "same_host_vs_tcp"):
        assert result[ratio] > 0, result
    assert 0 < result["delta_fraction"] < 0.5, result  # a delta of a training step is a fraction of the version
    assert result["resume_bytes_vs_one_copy"] >= 1.0, result  # the cut version did arrive whole
