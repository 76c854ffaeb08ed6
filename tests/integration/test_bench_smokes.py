"""The benches without a test of their own run in their --smoke mode and end with their JSON line of
ratios (`<ours>_vs_<baseline>`): a bench that CI runs does not rot unseen. The others have their own
tests (test_bench_<name>.py), which also check what their figures mean."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@pytest.mark.timeout(420)
@pytest.mark.parametrize("bench", ["codec", "weight_plane", "pipeline", "trainer", "modes", "rollout", "load", "gpu",
                                   "tinker_gateway", "tinker_recipe", "long_generations"])
def test_a_bench_smoke_ends_with_its_ratios(bench: str) -> None:
    proc = subprocess.run([sys.executable, f"bench/{bench}.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios = {k: v for k, v in result.items() if "_vs_" in k}
    assert ratios, f"{bench}: no <ours>_vs_<baseline> ratio in {sorted(result)}"
    assert all(math.isfinite(x) for x in _numbers(result))
    assert all(v > 0 for v in ratios.values() if not isinstance(v, dict)), ratios
