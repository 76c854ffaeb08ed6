"""The sampling contract on the trainer's side: log-probs (and the loss) under the distribution
that drew the tokens, temperature, top-k and top-p replayed as the rollout's samplers apply them.

Each result is checked against a plain hand computation (full logits divided by the temperature,
the kept set built token by token, autograd for the gradient), and against the rollout's own
transformers sampler (`process_logits`), so the two services cannot drift apart."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.common.types import SamplingSpec
from flywheel.errors import InvalidArgument
from services.rollout.engine.hf_sequence import process_logits
from services.trainer import forward
from services.trainer.forward import Sampling, _TargetLogprob
from services.trainer.loss_request import LossRequest
from tests.unit.trainer.trainer_helpers import make_batch


def _kept(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The kept set of one row of scaled logits, built the slow way: by rank, then by mass above."""
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    keep = set(order[:top_k]) if top_k else set(order)
    if top_p < 1:
        kept_order = [i for i in order if i in keep]
        probs = torch.softmax(row[kept_order], -1)
        above, chosen = 0.0, set()
        for i, p in zip(kept_order, probs.tolist()):
            if above < top_p:
                chosen.add(i)
            above += p
        keep = chosen
    mask = torch.zeros(len(row), dtype=torch.bool)
    mask[sorted(keep)] = True
    return mask


def _hand(logits: torch.Tensor, targets: torch.Tensor, temperature: list[float], top_k: list[int],
          top_p: list[float]) -> torch.Tensor:
    out = []
    for i in range(len(targets)):
        scaled = logits[i] / temperature[i]
        keep = _kept(scaled.detach(), top_k[i], top_p[i])
        keep[targets[i]] = True
        out.append(scaled[targets[i]] - torch.logsumexp(scaled[keep], -1))
    return torch.stack(out)


CASES = {
    "temperature": ([0.7] * 7, [0] * 7, [1.0] * 7),
    "top_k": ([1.0] * 7, [5] * 7, [1.0] * 7),
    "top_p": ([0.7] * 7, [0] * 7, [0.8] * 7),
    "all, per row": ([0.5, 0.7, 1.0, 1.3, 0.7, 0.9, 0.6], [10, 0, 3, 0, 1, 20, 0], [0.9, 0.8, 1.0, 0.5, 1.0, 0.95, 0.3]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_replayed_logprobs_and_gradients_match_the_hand_computation(case: str, monkeypatch) -> None:
    monkeypatch.setattr(forward, "_CHUNK_ROWS", 3)  # several chunks, the last one short
    temperature, top_k, top_p = CASES[case]
    torch.manual_seed(3)
    logits = (torch.randn(7, 40) * 3).requires_grad_()
    targets = torch.randint(0, 40, (7,))
    weights = torch.randn(7)
    sampling = Sampling(
        torch.tensor(temperature), torch.tensor(top_k) if any(top_k) else None,
        torch.tensor(top_p) if min(top_p) < 1 else None)
    ours = _TargetLogprob.apply(logits, targets, sampling)
    (ours * weights).sum().backward()
    ours_grad, logits.grad = logits.grad.clone(), None
    theirs = _hand(logits, targets, temperature, top_k, top_p)
    (theirs * weights).sum().backward()
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(ours_grad, logits.grad, atol=1e-5)
    assert torch.isfinite(ours).all(), "a sampled token outside the kept set still has a log-prob"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, -1, 1.0), (0.7, -1, 0.8), (1.0, 8, 0.9), (0.6, 20, 0.5)])
def test_the_trainer_keeps_the_set_the_rollout_sampler_kept(temperature: float, top_k: int, top_p: float) -> None:
    """On the same logits, the trainer's log-prob of every token the rollout's sampler can draw equals
    the log-prob that sampler reports for it (its processed distribution)."""
    torch.manual_seed(4)
    logits = torch.randn(5, 300) * 2
    spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p)
    d = spec.distribution("processed")
    for row in logits:
        reported = torch.log_softmax(process_logits(row, spec, [], 1, set()), -1)
        drawable = torch.isfinite(reported).nonzero().flatten()
        sampling = Sampling(torch.full((len(drawable),), d.temperature),
                            torch.full((len(drawable),), d.top_k) if d.top_k else None,
                            torch.full((len(drawable),), d.top_p) if d.top_p < 1 else None)
        ours = _TargetLogprob.apply(row.expand(len(drawable), -1), drawable, sampling)
        assert torch.allclose(ours, reported[drawable], atol=1e-5)


def _loss_by_hand(engine, batch: dict, temperature: float) -> float:
    """GRPO (clip 0.2, seq-mean-token-mean, no KL) with the policy's logits divided by T."""
    model = engine.policy.model
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:]
    ratio = torch.exp(logp - batch["behaviour_logprobs"][:, 1:])
    adv = batch["advantages"][:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1)
    return float(per_seq.mean())


def test_the_loss_at_temperature_t_is_the_reference_formulation(make_engine) -> None:
    engine = make_engine(model={"autocast": "none"})
    batch = make_batch(batch_size=4)
    result = engine.forward_backward({**batch, "sampling_temperature": torch.full((4,), 0.7)}, LossRequest(kind="grpo"))
    assert result.metrics["loss"] == pytest.approx(_loss_by_hand(engine, batch, 0.7), rel=1e-4, abs=1e-6)
    # ... and it is not the untempered loss (the check could fail).
    assert not math.isclose(result.metrics["loss"], _loss_by_hand(engine, batch, 1.0), rel_tol=1e-3)


def test_compute_logprobs_replays_the_contract(make_engine) -> None:
    engine = make_engine(model={"autocast": "none"})
    batch = make_batch(batch_size=2)
    raw, _ = engine.compute_logprobs(batch)
    tempered, _ = engine.compute_logprobs({**batch, "sampling_temperature": torch.tensor([0.5, 1.0])})
    real = batch["attention_mask"][:, 1:] > 0
    assert torch.allclose(tempered[1], raw[1]), "temperature 1 is the raw distribution"
    assert not torch.allclose(tempered[0, 1:][real[0]], raw[0, 1:][real[0]], atol=1e-3)


@pytest.mark.parametrize(("name", "value", "why"), [
    ("sampling_temperature", torch.tensor([0.0, 1.0, 1.0, 1.0]), "> 0"),
    ("sampling_temperature", torch.tensor([0.7, 0.7]), "does not match"),
    ("sampling_top_k", torch.tensor([-1, 0, 0, 0]), ">= 0"),
    ("sampling_top_p", torch.tensor([1.5, 1.0, 1.0, 1.0]), "(0, 1]"),
    ("sampling_top_k", torch.tensor([0.5, 0.0, 0.0, 0.0]), "integer"),
])
def test_bad_sampling_fields_are_refused_by_name(make_engine, name: str, value: torch.Tensor, why: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidArgument, match=f"batch.{name}.*{__import__('re').escape(why)}"):
        engine.forward_backward({**make_batch(batch_size=4), name: value}, LossRequest(kind="grpo"))
    assert engine.info().step == 0
