"""Both engines record the sampler's kept set where a cut applied: top-k's set is the model's k most
likely tokens at each position (checked against a plain forward pass), a grammar's positions are flagged
constrained with their allowed tokens, and nothing is recorded where nothing was cut. vLLM's come from
its processed top log-probs (asked for engine.max_kept_ids + 1 of them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from flywheel.common.types import SamplingSpec
from services.rollout.engine.text import TextCodec
from services.rollout.openai_api.constraints import json_value, structural
from tests.unit.rollout.rollout_helpers import engine_args

PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["transformers", "vllm"])
async def engine(request, rollout_model: Path, codec: TextCodec):
    if request.param == "vllm":
        pytest.importorskip("vllm")
        from services.rollout.engine.vllm_engine import VllmEngine

        made = VllmEngine(rollout_model, engine_args("vllm"), codec)
    else:
        from services.rollout.engine.transformers_engine import TransformersEngine

        made = TransformersEngine(rollout_model, engine_args("transformers"), codec)
    made.max_kept_ids = 16
    await made.start()
    yield made
    await made.stop()


async def _sample(engine, spec: SamplingSpec):
    async for deltas in engine.generate("r", list(PROMPT), spec, stream=False):
        for d in deltas:
            if d.final is not None:
                return d.final
    raise AssertionError("no final sample")


@pytest.mark.asyncio(loop_scope="module")
async def test_top_k_records_the_models_k_most_likely_tokens(engine, rollout_model: Path) -> None:
    sample = await _sample(engine, SamplingSpec(temperature=1.0, top_k=5, max_tokens=12, ignore_eos=True, seed=3))
    assert [k.position for k in sample.kept_sets] == list(range(12))
    model = AutoModelForCausalLM.from_pretrained(rollout_model).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + sample.token_ids])).logits[0, len(PROMPT) - 1:-1]
    for k, row, token in zip(sample.kept_sets, logits, sample.token_ids):
        assert k.size == 5 and set(k.token_ids) == set(torch.topk(row, 5).indices.tolist()) and token in k.token_ids
        assert not k.constrained


@pytest.mark.asyncio(loop_scope="module")
async def test_a_grammars_positions_are_flagged_with_their_allowed_tokens(engine, codec: TextCodec) -> None:
    sample = await _sample(engine, SamplingSpec(temperature=1.0, max_tokens=24, seed=1,
                                                constraint=structural(json_value(SCHEMA))))
    assert sample.kept_sets and all(k.constrained for k in sample.kept_sets)
    first = sample.kept_sets[0]
    assert first.position == 0 and first.carried
    assert all(codec.decode([i]).lstrip().startswith("{") for i in first.token_ids)
    for k in sample.kept_sets:
        assert not k.carried or sample.token_ids[k.position] in k.token_ids


@pytest.mark.asyncio(loop_scope="module")
async def test_nothing_is_recorded_where_nothing_was_cut(engine) -> None:
    sample = await _sample(engine, SamplingSpec(temperature=1.0, max_tokens=6, ignore_eos=True, seed=2))
    assert sample.kept_sets == []


def test_vllms_routed_experts_become_the_positions_fed() -> None:
    # What a GPU build's Model Runner V2 returns with enable_return_routed_experts (numpy [positions, L, K]);
    # the CPU build cannot return any, so only the conversion is checked here.
    import numpy as np

    from services.rollout.engine.vllm_outputs import routed_experts

    routed = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8
    assert routed_experts(routed, 6).tolist() == routed.tolist()  # prompt + completion - 1 rows
    assert routed_experts(routed, 5).tolist() == routed[:4].tolist()  # a row for the last token: dropped
    assert routed_experts(routed, 9) is None  # does not cover the sample: left out
    assert routed_experts(routed.astype(np.uint16), 6).dtype == torch.int16
    assert routed_experts(None, 6) is None
