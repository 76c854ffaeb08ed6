"""The sampler's kept set, by construction on saved logits: a fully-async run's samples two versions
old, drawn with top_p 0.8. The rollout's own sampler code (process_logits, choose, kept_set: what the
transformers engine's Sequence.step runs) draws each token from the old version's logits and records
its kept set; the controller builds the TrainBatch (build_train_batch, fully-async bound, policy
correct); the trainer validates it (training_batch) and takes its log-probs (token_logprobs) from the
current version's logits. With the kept sets, the trainer's distributions are truncated to exactly
the sampler's supports; without them it rebuilds the sets from its own logits, and the mismatch shows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flywheel.common.kept import kept_set
from flywheel.common.provenance import VersionSpan
from flywheel.common.types import SampledDistribution, SamplingSpec
from services.controller.batches.batching import TokenBound, build_train_batch
from services.controller.domain import Task, Trajectory
from services.rollout.engine.hf_sequence import choose, process_logits
from services.trainer import forward
from services.trainer.batch import BatchLimits, training_batch
from services.trainer.forward import Sampling, token_logprobs

VOCAB, TOKENS, TOP_P = 60, 40, 0.8
SAMPLED_AT, TRAINED_AT = 3, 5  # two versions old


class SavedLogits(nn.Module):
    """A 'model' whose next-token logits are saved ones: row t of `logits` predicts token t + 1."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False):
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1], VOCAB)
        out[0, : len(self.logits)] = self.logits
        return SimpleNamespace(logits=out)


def _saved(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling version's logits and the current version's (two optimizer steps on: moved a little)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(TOKENS, VOCAB, generator=g) * 2.5
    new = old + torch.randn(TOKENS, VOCAB, generator=g) * 0.6
    return old, new


def _sampled(old: torch.Tensor, max_ids: int) -> tuple[list[int], list[float], list]:
    """What the rollout's sampler does at each position (hf_sequence.Sequence.step's functions)."""
    spec = SamplingSpec(temperature=1.0, top_p=TOP_P, max_tokens=TOKENS)
    g = torch.Generator().manual_seed(1)
    tokens, logprobs, kept = [], [], []
    for i, logits in enumerate(old):
        processed = process_logits(logits, spec, [], i, set())
        token = choose(processed, spec, g)
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(processed, -1)[token]))
        kept.append(kept_set(processed, i, max_ids))
    return tokens, logprobs, kept


def _trained(new: torch.Tensor, tokens: list[int], logprobs: list[float], kept: list, with_kept: bool):
    trajectory = Trajectory(
        task=Task(id="t", prompt="p", index=0, epoch=0), prompt_ids=[7], response_ids=tokens, response_logprobs=logprobs,
        response_mask=[1] * TOKENS, version_start=SAMPLED_AT, version_end=SAMPLED_AT,
        distribution=SampledDistribution(top_p=TOP_P), version_spans=[VersionSpan(SAMPLED_AT, 0, TOKENS)],
        kept_sets=[k for k in kept if k is not None] if with_kept else [], advantage=1.0,
    )
    # Fully-async, policy correct: the tokens two versions old train (with the IS correction), none masked.
    built = build_train_batch([trajectory], TRAINED_AT, bound=TokenBound(4, correct=True))
    batch = training_batch(built.tensors, BatchLimits(10_000, 1_000, VOCAB), weight_version=TRAINED_AT,
                           needs_behaviour=True)
    model = SavedLogits(new)
    sampling = (batch.sampling_temperature, batch.sampling_top_k, batch.sampling_top_p)
    kept_args = (batch.sampler_kept_size, batch.sampler_kept_ids)
    logprobs_out, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, select=batch.loss_mask,
                                     sampling=sampling, kept=kept_args)
    # The support each position's log-prob was taken over (forward's own cut of the current logits).
    rows = torch.zeros(TOKENS, dtype=torch.int64)
    size = None if kept_args[0] is None else kept_args[0][0, 1:]
    ids = None if kept_args[1] is None else kept_args[1][0, 1:]
    per_position = Sampling.of_rows(*sampling, rows=rows, kept_size=size, kept_ids=ids)
    cut, _ = forward._processed(new, torch.tensor(tokens), per_position, slice(0, TOKENS))
    return built, logprobs_out[0, 1:], torch.isfinite(cut)


def test_with_the_samplers_kept_set_a_stale_samples_support_is_the_samplers_exactly() -> None:
    old, new = _saved()
    tokens, logprobs, kept = _sampled(old, max_ids=VOCAB)
    sampler_support = torch.stack([torch.isfinite(process_logits(l, SamplingSpec(top_p=TOP_P), [], 0, set()))
                                   for l in old])
    assert all(k is not None and k.carried for k in kept)
    built, trained, support = _trained(new, tokens, logprobs, kept, with_kept=True)
    assert built.sampler_counts["kept_ids"] == TOKENS and built.token_ages == {TRAINED_AT - SAMPLED_AT: TOKENS}
    assert torch.equal(support, sampler_support)
    # The log-prob of each token under the current weights, renormalised over the sampler's support.
    want = torch.stack([new[i, t] - torch.logsumexp(new[i][sampler_support[i]], -1) for i, t in enumerate(tokens)])
    assert torch.allclose(trained, want, atol=1e-5)


def test_without_it_the_trainers_rebuilt_sets_differ_and_so_do_its_logprobs() -> None:
    old, new = _saved()
    tokens, logprobs, kept = _sampled(old, max_ids=VOCAB)
    sampler_support = torch.stack([torch.isfinite(process_logits(l, SamplingSpec(top_p=TOP_P), [], 0, set()))
                                   for l in old])
    _, trained, support = _trained(new, tokens, logprobs, kept, with_kept=False)
    differ = (support != sampler_support).any(-1)
    assert differ.float().mean() > 0.3, "the current version's top-p sets should differ from the sampler's"
    want = torch.stack([new[i, t] - torch.logsumexp(new[i][sampler_support[i]], -1) for i, t in enumerate(tokens)])
    assert (trained - want)[differ].abs().max() > 1e-2
    assert torch.allclose(trained[~differ], want[~differ], atol=1e-5)


def test_a_set_too_big_to_carry_keeps_as_many_of_the_trainers_tokens() -> None:
    old, new = _saved()
    tokens, logprobs, kept = _sampled(old, max_ids=2)
    assert any(k is not None and not k.carried for k in kept)
    built, _, support = _trained(new, tokens, logprobs, kept, with_kept=True)
    assert built.sampler_counts["kept_size_only"] > 0
    for i, k in enumerate(kept):
        if k is not None and not k.carried:
            assert int(support[i].sum()) in (k.size, k.size + 1)  # the sampled token is always kept too


def test_a_kept_set_without_its_token_is_refused() -> None:
    from flywheel.errors import InvalidArgument

    old, new = _saved()
    tokens, logprobs, kept = _sampled(old, max_ids=VOCAB)
    first = next(k for k in kept if k is not None)
    wrong = first._replace(token_ids=tuple(i for i in range(VOCAB) if i != tokens[first.position])[: first.size])
    with pytest.raises(InvalidArgument, match="not in its kept set"):
        _trained(new, tokens, logprobs, [wrong if k is first else k for k in kept], with_kept=True)


def test_the_gradient_is_that_of_the_log_prob_over_the_recorded_set(monkeypatch) -> None:
    monkeypatch.setattr(forward, "_CHUNK_ROWS", 7)  # several chunks, the last one short
    old, new = _saved()
    tokens, _, kept = _sampled(old, max_ids=VOCAB)
    width = max(len(k.token_ids) for k in kept)
    ids = torch.full((TOKENS, width), -1)
    for i, k in enumerate(kept):
        ids[i, :len(k.token_ids)] = torch.tensor(k.token_ids)
    sampling = Sampling(None, None, torch.full((TOKENS,), TOP_P), torch.tensor([k.size for k in kept]), ids)
    logits = new.clone().requires_grad_()
    ours = forward._TargetLogprob.apply(logits, torch.tensor(tokens), sampling)
    weights = torch.randn(TOKENS, generator=torch.Generator().manual_seed(4))
    (ours * weights).sum().backward()
    ours_grad, logits.grad = logits.grad.clone(), None
    support = torch.zeros(TOKENS, VOCAB, dtype=torch.bool)
    for i, k in enumerate(kept):
        support[i, list(k.token_ids)] = True
    theirs = torch.stack([logits[i, t] - torch.logsumexp(logits[i][support[i]], -1) for i, t in enumerate(tokens)])
    (theirs * weights).sum().backward()
    assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(ours_grad, logits.grad, atol=1e-5)
