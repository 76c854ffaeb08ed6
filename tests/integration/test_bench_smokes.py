"""The benches without a test of their own run in their --smoke mode and end with their JSON line of
ratios (`<ours>_vs_<baseline>`): a bench that CI runs does not rot unseen. The others have their own
tests (test_bench_<name>.py), which also check what their figures mean."""

from __future__ import annotations

import math

import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@pytest.mark.timeout(420)
@pytest.mark.parametrize("bench", ["codec", "weight_plane", "pipeline", "trainer", "modes", "rollout", "load", "gpu",
                                   "remote_judge", "tinker_gateway", "tinker_recipe", "long_generations",
                                   "routing_replay", "distill", "staleness_policies", "environments",
                                   "environments --environment verifiers"])
def test_a_bench_smoke_ends_with_its_ratios(bench: str) -> None:
    bench, *args = bench.split()
    result = run_smoke(bench, 400, *args)
    ratios = {k: v for k, v in result.items() if "_vs_" in k}
    assert ratios, f"{bench}: no <ours>_vs_<baseline> ratio in {sorted(result)}"
    assert all(math.isfinite(x) for x in _numbers(result))
    assert all(v > 0 for v in ratios.values() if not isinstance(v, dict)), ratios
