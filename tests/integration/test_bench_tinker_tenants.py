"""bench/tinker_tenants.py --smoke: several SDK clients at once on one gateway, each on its own model and
key, sample their own adapters side by side: the rollout never reloads its base nor pauses for an
install, every save is an adapter it loads, and a tenant alone gets exactly the losses it got among
the others."""

from __future__ import annotations

import pytest

from tests.integration.bench_smoke import run_smoke

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_tenants_sample_side_by_side_without_reloads_or_pauses_and_train_as_alone() -> None:
    result = run_smoke("tinker_tenants", 280)
    assert result["base_reloads"] == 0 and result["foreign_pause_seconds"] == 0
    # Every round of every tenant saved new weights for the sampler, each loaded once as an adapter.
    assert result["adapter_loads"] >= result["tenants"] * result["rounds"]
    assert result["losses_identical_alone"] is True and result["tenants_checked_alone"] >= 1
    assert result["tenants_vs_one"] > 0 and result["interleaved_vs_batched_trainer"] > 0
