"""A LoRA run through the controller moves the rollout's weights.

Real synchronizer, trainer (LoRA adapters on the attention projections) and
rollout processes, the controller driving 4 GRPO steps. The trainer publishes
merged weights (the rollout serves a full model and cannot load adapters), so
every sync is accepted, and the rollout's greedy output changes (the reward is
the completion's length, which varies across a random model's samples).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flywheel.rollout.client import RolloutClient
from tests.integration.service_processes import Cluster, jsonl, prepare_tiny_model, tiny_run

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 9], [100, 3, 77], [8, 8, 8, 8, 8]]


async def greedy(address: str) -> tuple[int, list[list[int]]]:
    async with RolloutClient(address) as rollout:
        results = await rollout.generate(PROMPTS, max_tokens=8, temperature=0.0)
        return (await rollout.status()).weight_version, [r[0].completion_token_ids for r in results]


@pytest.mark.timeout(900)
def test_a_lora_run_syncs_merged_weights_and_moves_greedy_output(tmp_path: Path) -> None:
    model = prepare_tiny_model()
    cluster = Cluster(tmp_path)
    try:
        sync = cluster.synchronizer()
        trainer = cluster.trainer(model, sync, optimizer={"lr": 5e-2},
                                  model={"lora": {"enabled": True, "rank": 8, "alpha": 16}})
        rollout = cluster.rollout("r0", model, sync)
        trainer.wait_ready(300)
        rollout.wait_ready(300)
        version, before = asyncio.run(greedy(rollout.grpc_address))
        assert version == 0
        run_dir = tmp_path / "run"
        # A random tiny model never answers arithmetic; the length reward (characters, closer to 10 is
        # better) varies across its samples, so GRPO has advantages to learn from.
        run = tiny_run("lora", 4, sync, trainer.grpc_address, mode="sync",
                       reward={"name": "length", "kwargs": {"target": 10}})
        controller = cluster.controller(run, run_dir)
        assert controller.wait(600) == 0, cluster.controller_output()
        rows = jsonl(run_dir / "trained_tasks.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        # Sync mode, FIXED(1, 0): every step trained on samples of the version before it: every sync landed.
        assert all({tuple(v) for v in r["sample_versions"]} == {(r["step"] - 1,) * 2} for r in rows), rows
        failures = [e for e in jsonl(run_dir / "synchronizer_events.jsonl") if "failed" in e.get("message", "")]
        assert failures == []
        version, after = asyncio.run(greedy(rollout.grpc_address))
        assert version >= 3
        assert after != before, "LoRA training moved the weights the rollout serves"
    finally:
        cluster.stop()
