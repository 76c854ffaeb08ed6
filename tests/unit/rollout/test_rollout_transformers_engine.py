"""The transformers engine decodes like a plain forward pass and honours the engine contract."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from services.rollout.engine.base import SamplingSpec, StagedWeights
from services.rollout.engine.transformers_engine import TransformersEngine
from tests.unit.rollout.rollout_helpers import reference_greedy, reference_logprobs

PROMPT = [318, 268, 223, 20, 284, 223, 21, 33]


@pytest_asyncio.fixture
async def engine(rollout_model: Path, codec):
    engine = TransformersEngine(rollout_model, {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 1}, codec)
    await engine.start()
    yield engine
    await engine.stop()


async def run(engine, spec: SamplingSpec, rid: str = "r", prompt=PROMPT, stream=False):
    finals, deltas = [], []
    async for batch in engine.generate(rid, list(prompt), spec, stream=stream):
        deltas += batch
        finals += [d.final for d in batch if d.final is not None]
    return sorted(finals, key=lambda s: s.index), deltas


async def test_greedy_matches_a_plain_forward_pass(engine, rollout_model: Path) -> None:
    (sample,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=10, ignore_eos=True, top_logprobs=3))
    assert sample.token_ids == reference_greedy(rollout_model, PROMPT, 10)
    assert sample.logprobs == pytest.approx(reference_logprobs(rollout_model, PROMPT, sample.token_ids), abs=1e-4)
    assert sample.finish_reason == "length" and (sample.version_start, sample.version_end) == (0, 0)
    assert all(top[0][1] >= top[-1][1] and len(top) == 3 for top in sample.top_logprobs)
    assert [top[0][0] for top in sample.top_logprobs] == sample.token_ids  # greedy picks the top token


async def test_streamed_deltas_add_up_to_the_final_sample(engine) -> None:
    (sample,), deltas = await run(engine, SamplingSpec(temperature=0, max_tokens=6, ignore_eos=True), stream=True)
    assert sum((d.token_ids for d in deltas), []) == sample.token_ids
    assert "".join(d.text for d in deltas) == sample.text


async def test_stop_string_ends_the_sample_and_is_cut(engine, codec) -> None:
    (free,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=6, ignore_eos=True))
    stop = codec.decode(free.token_ids[2:3]).strip() or codec.decode(free.token_ids[2:3])
    (sample,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=6, ignore_eos=True, stop=(stop,)))
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert stop not in sample.text and len(sample.token_ids) <= 3


async def test_seeded_sampling_is_reproducible(engine) -> None:
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    first, _ = await run(engine, spec, "a")
    again, _ = await run(engine, spec, "b")
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert len({tuple(s.token_ids) for s in first}) > 1


async def test_pause_keep_then_swap_continues_on_new_weights(engine, rollout_model: Path) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=40, ignore_eos=True)
    task = asyncio.create_task(run(engine, spec))
    while engine.load().running == 0:
        await asyncio.sleep(0.001)
    await engine.pause("keep")
    new = {k: v * 1.5 for k, v in load_file(str(rollout_model / "model.safetensors")).items()}
    await engine.swap_weights(StagedWeights(version=1, tensors=new))
    await engine.resume()
    (sample,), _ = await task
    assert (sample.version_start, sample.version_end) == (0, 1)
    assert engine.version == 1
    # Which token each version made: the ones before the swap are 0's, the rest 1's, in two spans.
    (old, fresh) = sample.version_spans
    assert (old.version, old.start, fresh.version, fresh.end) == (0, 0, 1, 40) and 0 < old.end == fresh.start < 40


async def test_pause_abort_ends_in_flight_samples(engine) -> None:
    task = asyncio.create_task(run(engine, SamplingSpec(n=2, temperature=1.0, max_tokens=100, ignore_eos=True)))
    while engine.load().running == 0:
        await asyncio.sleep(0.001)
    await engine.pause("abort")
    samples, _ = await task
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    await engine.resume()
    (after,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=2, ignore_eos=True))
    assert after.finish_reason == "length"


async def test_a_step_that_fails_fails_its_requests_and_the_engine_serves_on(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its requests end with the error at once; before, the loop died and every request, these and the
    later ones, waited for tokens forever."""
    step_one = engine._step_one

    def fails_once(seq, version):
        monkeypatch.setattr(engine, "_step_one", step_one)
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(engine, "_step_one", fails_once)
    spec = SamplingSpec(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        await asyncio.wait_for(run(engine, spec, "failed"), 30)
    assert engine.load().running == engine.load().waiting == 0
    (after,), _ = await asyncio.wait_for(run(engine, SamplingSpec(temperature=0, max_tokens=2, ignore_eos=True)), 30)
    assert after.finish_reason == "length" and len(after.token_ids) == 2


async def test_pause_wait_drains_first(engine) -> None:
    task = asyncio.create_task(run(engine, SamplingSpec(temperature=0, max_tokens=12, ignore_eos=True)))
    while engine.load().running == 0:
        await asyncio.sleep(0.001)
    await engine.pause("wait")
    assert task.done()
    (sample,), _ = await task
    assert sample.finish_reason == "length" and len(sample.token_ids) == 12
    await engine.resume()


async def test_weight_swap_changes_greedy_output(engine, rollout_model: Path) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    (before,), _ = await run(engine, spec)
    state = {k: v * 2.0 for k, v in load_file(str(rollout_model / "model.safetensors")).items()}
    await engine.pause("wait")
    await engine.swap_weights(StagedWeights(version=3, tensors=state))
    await engine.resume()
    (after,), _ = await run(engine, spec)
    assert after.token_ids == reference_greedy(rollout_model, PROMPT, 8, state)
    assert after.token_ids != before.token_ids and after.version_start == 3
    torch.testing.assert_close(engine.model.state_dict()["model.norm.weight"], state["model.norm.weight"])


def test_a_device_it_cannot_use_is_refused_before_it_loads(rollout_model: Path, codec) -> None:
    from flywheel.errors import FailedPrecondition, InvalidArgument

    with pytest.raises(InvalidArgument, match="engine.args.device"):
        TransformersEngine(rollout_model, {"device": "no-such-device"}, codec)
    if not torch.cuda.is_available():
        with pytest.raises(FailedPrecondition, match="no CUDA device"):
            TransformersEngine(rollout_model, {"device": "cuda:0"}, codec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_on_cuda_it_decodes_like_a_plain_forward_pass_and_swaps_weights_there(rollout_model: Path, codec) -> None:
    engine = TransformersEngine(rollout_model, {"device": "cuda:0", "dtype": "float32", "max_model_len": 128}, codec)
    await engine.start()
    try:
        assert next(engine.model.parameters()).device.type == "cuda"
        (sample,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=10, ignore_eos=True))
        assert sample.token_ids == reference_greedy(rollout_model, PROMPT, 10)  # TF32 off: float32 on both
        new = {name: t * 1.5 for name, t in load_file(str(rollout_model / "model.safetensors")).items()}
        staged = StagedWeights(version=1, tensors=new, nbytes=sum(t.nbytes for t in new.values()))
        await engine.pause("wait")
        await engine.swap_weights(staged)
        await engine.resume()
        (after,), _ = await run(engine, SamplingSpec(temperature=0, max_tokens=10, ignore_eos=True))
        assert after.token_ids == reference_greedy(rollout_model, PROMPT, 10, new)
        assert (after.version_start, after.version_end) == (1, 1)
    finally:
        await engine.stop()


async def test_staging_tensors_handed_back_are_traded_not_copied(engine, rollout_model: Path) -> None:
    """A MEMORY pull's staging tensors (released for the next update) become the model's weights as
    they are, and the model's previous tensors go back in their place, to be staged into next time."""
    spec = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    state = {k: v * 2.0 for k, v in load_file(str(rollout_model / "model.safetensors")).items()}
    staging = {k: v.clone() for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in staging.items()}
    before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    released = []
    await engine.pause("wait")
    await engine.swap_weights(StagedWeights(version=4, tensors=staging, release=lambda: released.append(True)))
    await engine.resume()
    params = dict(engine.model.named_parameters())
    traded = [n for n in staging if n in params and params[n].data_ptr() == pointers[n]]
    assert traded, "no staging tensor became a weight"
    assert all(staging[n].data_ptr() == before[n] for n in traded), "the previous tensors went back"
    (after,), _ = await run(engine, spec)
    assert after.token_ids == reference_greedy(rollout_model, PROMPT, 8, state)


async def test_sampled_log_probs_are_of_the_distribution_that_drew_them_unless_raw_is_asked(
        engine, rollout_model: Path) -> None:
    """Processed (the default): log softmax of the logits / T over the top-p set, as vLLM's processed_logprobs;
    raw on request: the model's own. The sample names which."""
    spec = SamplingSpec(n=2, temperature=0.7, top_p=0.8, max_tokens=6, seed=3, ignore_eos=True)
    processed, _ = await run(engine, engine.resolve_logprobs_mode(spec), rid="p")
    raw, _ = await run(engine, engine.resolve_logprobs_mode(SamplingSpec(**{**spec.__dict__, "logprobs_mode": "raw"})),
                       rid="r")
    assert [s.token_ids for s in processed] == [s.token_ids for s in raw], "the same seed draws the same tokens"
    for p, r in zip(processed, raw):
        assert (p.distribution.temperature, p.distribution.top_p) == (0.7, 0.8) and r.distribution.raw
        assert r.logprobs == pytest.approx(reference_logprobs(rollout_model, PROMPT, r.token_ids), abs=1e-4)
        # The tempered, truncated and renormalised distribution gives drawn tokens more mass than the raw one.
        assert sum(p.logprobs) > sum(r.logprobs)


def test_an_engine_with_one_log_prob_mode_refuses_the_other_where_they_differ() -> None:
    from flywheel.errors import InvalidArgument
    from services.rollout.engine.base import Engine

    class OneMode(Engine):  # vLLM's kind: the mode is engine-wide
        kind = "vllm"

    OneMode.__abstractmethods__ = frozenset()  # only the base's mode resolution is exercised
    engine = OneMode()
    assert engine.resolve_logprobs_mode(SamplingSpec(temperature=0.7)).logprobs_mode == "processed"
    with pytest.raises(InvalidArgument, match="raw log-probs were asked for.*engine.logprobs"):
        engine.resolve_logprobs_mode(SamplingSpec(temperature=0.7, logprobs_mode="raw"))
    # Where the two are the same distribution (greedy; temperature 1 with nothing cut), either is served.
    assert engine.resolve_logprobs_mode(SamplingSpec(temperature=0, logprobs_mode="raw")).logprobs_mode == "raw"
    assert engine.resolve_logprobs_mode(SamplingSpec(temperature=1.0, logprobs_mode="raw")).logprobs_mode == "raw"


async def test_alternatives_are_only_tokens_the_sampling_distribution_can_draw(engine) -> None:
    """Top-k 2 keeps two tokens: asking for 5 alternatives gives at most those two, none at -inf."""
    spec = engine.resolve_logprobs_mode(SamplingSpec(temperature=0.8, top_k=2, max_tokens=4, seed=1, top_logprobs=5,
                                                     ignore_eos=True))
    (sample,), _ = await run(engine, spec)
    assert all(1 <= len(top) <= 2 for top in sample.top_logprobs)
    assert all(lp > -float("inf") for top in sample.top_logprobs for _, lp in top)


async def test_prompt_log_probs_are_a_plain_forward_pass_over_the_prompt(engine, rollout_model: Path) -> None:
    """Each sample's prefill scores the prompt: log p(prompt[i + 1] | prompt[:i + 1]) under the model's raw
    distribution, whatever the sampling (tempered, truncated) and its log-probs."""
    spec = engine.resolve(SamplingSpec(n=2, temperature=0.7, top_k=5, max_tokens=3, seed=2, ignore_eos=True,
                                       prompt_logprobs=True))
    samples, _ = await run(engine, spec)
    expected = reference_logprobs(rollout_model, PROMPT[:1], PROMPT[1:])
    for sample in samples:
        assert len(sample.prompt_logprobs) == len(PROMPT) - 1
        # measured: 0.0 (the prefill is the same forward, float32)
        assert sample.prompt_logprobs == pytest.approx(expected, abs=1e-6)
    (plain,), _ = await run(engine, SamplingSpec(max_tokens=1), rid="plain")
    (one,), _ = await run(engine, SamplingSpec(max_tokens=1, prompt_logprobs=True), rid="one", prompt=PROMPT[:1])
    assert plain.prompt_logprobs == [] and one.prompt_logprobs == []  # not asked; nothing before the only token
