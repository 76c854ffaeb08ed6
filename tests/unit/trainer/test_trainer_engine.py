"""The training engine in-process on a tiny model: steps, micro-batches, rejections."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.errors import FailedPrecondition, InvalidArgument
from services.trainer.forward import token_logprobs
from services.trainer.loss_request import LossRequest
from tests.unit.trainer.trainer_helpers import (
    make_batch,
    optimizer_state,
    parameters,
    same_tensors,
)

GRPO = LossRequest(kind="grpo")


def test_info(make_engine) -> None:
    engine = make_engine()
    info = engine.info()
    assert info.ready and info.step == 0 and info.weight_version == 0
    assert info.parameter_count == sum(p.numel() for p in engine.policy.model.parameters())
    assert info.trainable_count == info.parameter_count
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.lora_rank, info.lora_target_modules) == (0, ())  # every parameter trains
    lora = make_engine(model={"lora": {"enabled": True, "rank": 4, "target_modules": ["q_proj", "lm_head"]}}).info()
    assert (lora.lora_rank, lora.lora_target_modules) == (4, ("q_proj", "lm_head"))
    assert lora.trainable_count < lora.parameter_count


def test_train_step_advances_step_and_reports_metrics(make_engine) -> None:
    engine = make_engine()
    batch = make_batch()
    result = engine.train_step(batch, GRPO)
    assert (result.step, result.weight_version) == (1, 1)
    assert result.tokens == int(batch["attention_mask"].sum())
    assert result.loss_tokens == int(batch["loss_mask"].sum())
    for name in ("loss", "pg_loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "learning_rate",
                 "staleness_mean", "staleness_max"):
        assert name in result.metrics, name
    assert result.metrics["grad_norm"] > 0 and result.metrics["learning_rate"] == pytest.approx(1e-3)
    assert engine.info().step == 1


def test_micro_batches_give_the_same_step_as_the_whole_batch(make_engine) -> None:
    batch = make_batch(batch_size=4)
    # eps well above rounding noise, as in test_sharded_engine: with eps 1e-8 Adam moves an element whose
    # gradient is only noise by a sizeable part of lr (2.04e-5 on a one-thread AMX Xeon, past the bound below).
    whole, split = make_engine(optimizer={"eps": 1e-6}), make_engine(optimizer={"eps": 1e-6})
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        loss = LossRequest(aggregation=aggregation, entropy_coef=0.01)
        a = whole.train_step(batch, loss, micro_batch_size=0)
        b = split.train_step(batch, loss, micro_batch_size=1)
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5), aggregation
        assert b.metrics["grad_norm"] == pytest.approx(a.metrics["grad_norm"], rel=1e-4), aggregation
        pa, pb = parameters(whole), parameters(split)
        # Adam's first steps are about lr * sign(grad), so rounding noise in
        # near-zero gradients moves weights by a small fraction of lr (1e-3): 4.2e-7 measured.
        assert all(torch.allclose(pa[k], pb[k], atol=2e-5) for k in pa), aggregation


def test_forward_backward_then_optim_step_equals_train_step(make_engine) -> None:
    batch = make_batch()
    one, two = make_engine(), make_engine()
    accumulated = one.forward_backward(batch, GRPO, expected_step=0)
    assert accumulated.loss_tokens == int(batch["loss_mask"].sum())
    assert (accumulated.step, accumulated.tokens) == (0, int(batch["attention_mask"].sum()))
    optim = one.optim_step(expected_step=0)
    step = two.train_step(batch, GRPO)
    assert (optim.step, optim.weight_version) == (1, 1)
    assert accumulated.metrics["loss"] == step.metrics["loss"]
    assert optim.grad_norm == step.metrics["grad_norm"]
    assert same_tensors(parameters(one), parameters(two))


def test_forward_backward_returns_each_datums_logprobs_of_its_own_forward_pass(make_engine) -> None:
    """In the caller's row order, although the engine reorders rows (by shared prompt, then length:
    rows 1 and 3 are shorter and go last), and as ComputeLogprobs gives them on the same weights."""
    engine = make_engine()
    batch = make_batch(batch_size=4, seq_len=16, prompt_len=8)
    batch["input_ids"][2, :8] = batch["input_ids"][0, :8]  # rows 0 and 2 share their prompt
    expected, _ = engine.compute_logprobs(batch, False, 0)
    result = engine.forward_backward(batch, GRPO)
    mask = batch["loss_mask"].bool()
    assert result.logprobs.shape == mask.shape and result.logprobs.dtype == torch.float32
    assert torch.allclose(result.logprobs[mask], expected[mask], atol=1e-5)
    assert not result.logprobs[~mask].any() and (result.logprobs[mask] < 0).all()
    rows = [int(r) for r in torch.randperm(4, generator=torch.Generator().manual_seed(3))]
    engine.policy.zero_grad()
    shuffled = engine.forward_backward({k: v[rows] for k, v in batch.items()}, GRPO)
    assert torch.allclose(shuffled.logprobs, result.logprobs[rows], atol=1e-5)


def test_tinker_cross_entropy_needs_no_sampler_logprobs_and_sums_weight_times_logprob(make_engine) -> None:
    """Supervised learning through ForwardBackward (Tinker's cross_entropy, sum reduction): per-token
    weights of any sign in `advantages`, no behaviour or old log-probs; the loss is -Σ w·logp over the
    very log-probs the call returns."""
    engine = make_engine()
    batch = make_batch()
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    sft = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
           "loss_mask": batch["loss_mask"], "advantages": weights}
    result = engine.forward_backward(sft, LossRequest(kind="cross_entropy"))
    mask = batch["loss_mask"]
    assert result.metrics["loss"] == pytest.approx(-float((weights * result.logprobs * mask).sum()), rel=1e-5)
    assert "clip_fraction" not in result.metrics
    before = parameters(engine)
    assert engine.optim_step().step == 1 and not same_tensors(before, parameters(engine))
    with pytest.raises(InvalidArgument, match="batch.behaviour_logprobs: missing"):
        engine.forward_backward(sft, LossRequest(kind="importance_sampling"))


def test_gradients_of_successive_forward_backward_calls_add_up(make_engine) -> None:
    engine = make_engine()
    engine.forward_backward(make_batch(seed=1), GRPO)
    first = {n: p.grad.clone() for n, p in engine.policy.model.named_parameters()}
    engine.forward_backward(make_batch(seed=2), GRPO)
    second = {n: p.grad for n, p in engine.policy.model.named_parameters()}
    assert any(not torch.equal(first[n], second[n]) for n in first)
    with pytest.raises(FailedPrecondition, match="pending"):
        engine.train_step(make_batch(), GRPO)  # would silently mix in the pending gradients
    assert engine.optim_step().step == 1


def test_a_forward_only_pass_reports_the_loss_and_logprobs_and_leaves_the_gradients_as_they_were(make_engine) -> None:
    """Tinker's forward: the same loss and log-probs a forward_backward would give, and no gradient
    made or dropped (it may come between the chunks of one step)."""
    engine = make_engine()
    engine.forward_backward(make_batch(seed=1), GRPO)
    pending = {n: p.grad.clone() for n, p in engine.policy.model.named_parameters() if p.grad is not None}
    probe = make_batch(seed=2)
    forward = engine.forward_backward(probe, GRPO, forward_only=True)
    after = {n: p.grad for n, p in engine.policy.model.named_parameters() if p.grad is not None}
    assert after.keys() == pending.keys() and all(torch.equal(after[n], pending[n]) for n in pending)
    both = engine.forward_backward(probe, GRPO)  # now accumulated, with the same loss and log-probs
    assert forward.metrics["loss"] == pytest.approx(both.metrics["loss"], rel=1e-5)
    assert torch.allclose(forward.logprobs, both.logprobs, atol=1e-6)
    fresh = make_engine()
    fresh.forward_backward(make_batch(seed=3), GRPO, forward_only=True)
    assert all(p.grad is None for p in fresh.policy.model.parameters())
    with pytest.raises(FailedPrecondition, match="no accumulated gradients"):
        fresh.optim_step()


def test_rejected_calls_leave_model_and_optimizer_bit_identical(make_engine) -> None:
    engine = make_engine()
    engine.train_step(make_batch(seed=1), GRPO)  # optimizer state exists
    params, opt = parameters(engine), optimizer_state(engine)
    batch = make_batch()
    nan_adv = {**batch, "advantages": torch.tensor([1.0, float("nan"), 0.0, 1.0])}
    bad_shape = {**batch, "loss_mask": batch["loss_mask"][:, :-1]}
    future = {**batch, "weight_versions": torch.tensor([0, 0, 0, 9])}
    # The second micro-batch overflows to an infinite loss after the first one's backward ran.
    overflow = {**batch, "advantages": torch.tensor([1.0, 3e38, 3e38, 3e38])}
    calls = [
        (InvalidArgument, "batch.advantages", lambda: engine.train_step(nan_adv, GRPO)),
        (InvalidArgument, "batch.loss_mask", lambda: engine.forward_backward(bad_shape, GRPO)),
        (FailedPrecondition, "batch.weight_versions", lambda: engine.train_step(future, GRPO)),
        (FailedPrecondition, "expected_step", lambda: engine.train_step(batch, GRPO, expected_step=0)),
        (FailedPrecondition, "expected_step", lambda: engine.optim_step(expected_step=7)),
        (FailedPrecondition, "no accumulated gradients", lambda: engine.optim_step()),
        (InvalidArgument, "loss.clip_low", lambda: engine.train_step(batch, LossRequest(clip_low=-0.1))),
        (InvalidArgument, "loss.is_cap", lambda: engine.train_step(batch, LossRequest(is_cap=float("nan")))),
        (FailedPrecondition, "loss is", lambda: engine.train_step(overflow, GRPO, micro_batch_size=1)),
    ]
    for error, field, call in calls:
        with pytest.raises(error, match=field):
            call()
        assert same_tensors(parameters(engine), params), field
        assert same_tensors(optimizer_state(engine), opt), field
        assert not engine.policy.has_gradients(), field
    assert engine.info().step == 1


def test_micro_batch_token_limit(make_engine) -> None:
    engine = make_engine(limits={"max_micro_batch_tokens": 24})
    batch = make_batch(batch_size=4, seq_len=12)
    with pytest.raises(InvalidArgument, match="max_micro_batch_tokens"):
        engine.train_step(batch, GRPO)
    assert engine.train_step(batch, GRPO, micro_batch_size=2).step == 1


def test_no_model_is_a_failed_precondition(make_engine) -> None:
    from services.trainer.config import TrainerConfig
    from services.trainer.training import TrainingEngine

    engine = TrainingEngine(TrainerConfig())
    assert not engine.info().ready
    with pytest.raises(FailedPrecondition, match="no model loaded"):
        engine.train_step(make_batch(), GRPO)


def test_compute_logprobs_and_reference(make_engine) -> None:
    engine = make_engine()
    batch = make_batch()
    before, version = engine.compute_logprobs(batch)
    assert version == 0 and before.shape == batch["input_ids"].shape and before.dtype == torch.float32
    assert (before[:, 0] == 0).all() and (before[batch["attention_mask"] == 0] == 0).all()
    # Token t's log-prob is log_softmax(logits at t - 1)[token t].
    with torch.no_grad():
        logits = engine.policy.model(input_ids=batch["input_ids"][:1, :3]).logits
    manual = torch.log_softmax(logits[0, 1], -1)[batch["input_ids"][0, 2]]
    assert float(before[0, 2]) == pytest.approx(float(manual), abs=1e-5)
    in_pieces, _ = engine.compute_logprobs(batch, micro_batch_size=3)
    assert torch.allclose(in_pieces, before, atol=1e-5)

    result = engine.train_step(batch, LossRequest(kl_coef=0.1))
    assert result.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    after, version = engine.compute_logprobs(batch)
    reference, _ = engine.compute_logprobs(batch, reference=True)
    assert version == 1 and not torch.allclose(after, before)
    assert torch.equal(reference, before)  # the reference stays the initial policy
    assert engine.train_step(batch, LossRequest(kl_coef=0.1)).metrics["kl"] > 0


def test_logprobs_ignore_padding_content(make_engine) -> None:
    engine = make_engine()
    ids = torch.tensor([[5, 6, 7, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    a, _ = engine.compute_logprobs({"input_ids": ids, "attention_mask": mask})
    b, _ = engine.compute_logprobs({"input_ids": torch.tensor([[5, 6, 7, 99, 42]]), "attention_mask": mask})
    assert torch.allclose(a, b, atol=1e-6)
    lp, _ = token_logprobs(engine.policy.model, ids[:, :3], mask[:, :3])
    assert torch.allclose(a[:, :3], lp, atol=1e-5)


def test_bfloat16_autocast_keeps_float32_parameters_and_close_logprobs(make_engine) -> None:
    batch = make_batch()
    exact = make_engine()
    mixed = make_engine(model={"autocast": "bfloat16"})
    want, _ = exact.compute_logprobs(batch)
    got, _ = mixed.compute_logprobs(batch)
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)  # the matmuls did run in bfloat16
    assert torch.allclose(got, want, atol=0.1)  # ... and agree to bfloat16's precision
    result = mixed.train_step(batch, GRPO)
    assert result.weight_version == 1 and math.isfinite(result.grad_norm)
    assert all(p.dtype == torch.float32 for p in mixed.policy.model.parameters())
    assert all(s.dtype == torch.float32 for s in optimizer_state(mixed) if s.is_floating_point())


def test_auto_autocast_is_bfloat16_only_where_the_device_has_it_natively(monkeypatch, caplog) -> None:
    from services.trainer import policy

    monkeypatch.setattr(policy, "native_bfloat16", lambda device: False)
    assert policy.autocast_dtype("auto", "cpu") is None
    assert policy.autocast_dtype("none", "cpu") is None
    with caplog.at_level("WARNING", logger=policy.log.name):
        assert policy.autocast_dtype("bfloat16", "cpu") is torch.bfloat16  # asked for: kept, with a warning
    assert "no native bfloat16" in caplog.text and "autocast: auto" in caplog.text
    monkeypatch.setattr(policy, "native_bfloat16", lambda device: True)
    assert policy.autocast_dtype("auto", "cpu") is torch.bfloat16
    assert policy.autocast_dtype("float16", "cpu") is torch.float16


def test_onednn_capped_below_avx512_has_no_native_bfloat16(monkeypatch) -> None:
    from services.trainer import policy

    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    for cap in ("AVX2", "avx2", "SSE41"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert policy.native_bfloat16("cpu") is False and policy.autocast_dtype("auto", "cpu") is None
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # oneDNN's older name
    assert policy.native_bfloat16("cpu") is False
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    # Uncapped, or capped at AVX-512 or above: what the CPU has.
    for cap in (None, "AVX512_CORE_AMX"):
        if cap:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert policy.native_bfloat16("cpu") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_micro_batches_are_ordered_by_length_and_cut_to_their_longest_row(make_engine, monkeypatch) -> None:
    """The trainer orders rows longest first and trims each micro-batch's padding: the model sees
    narrower micro-batches, and the step is the one the padded batch gives."""
    import services.trainer.training as training

    widths = []
    real = training.token_logprobs

    def spy(model, input_ids, *args, **kwargs):
        widths.append(int(input_ids.shape[1]))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(training, "token_logprobs", spy)
    batch = make_batch(batch_size=4, seq_len=12)  # rows 1 and 3 end early (lengths 12, 11, 12, 9)
    trimmed, padded = make_engine(), make_engine()
    a = trimmed.train_step(batch, GRPO, micro_batch_size=2)
    assert widths == [12, 11], "rows 0 and 2 together, then rows 1 and 3 cut to 11 columns"
    monkeypatch.setattr(training, "token_logprobs", real)
    monkeypatch.setattr(training.Batch, "trimmed", lambda self: self)
    b = padded.train_step(batch, GRPO, micro_batch_size=2)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    pa, pb = parameters(trimmed), parameters(padded)
    assert all(torch.allclose(pa[k], pb[k], atol=2e-5) for k in pa)  # Adam: see the test above


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_samples_of_one_prompt_share_its_forward_and_the_step_is_unchanged(make_engine, monkeypatch, lora) -> None:
    """GRPO groups (the same prompt sampled n times) train together, the prompt computed once per
    micro-batch (Batch.planned, forward.token_logprobs): the same loss and update as row by row."""
    import services.trainer.batch as batch_module
    import services.trainer.training as training

    batch = make_batch(batch_size=6, seq_len=16, prompt_len=9)  # row r ends r tokens early
    for first in (0, 3):  # two questions, three samples each
        batch["input_ids"][first:first + 3, :9] = batch["input_ids"][first, :9]
    seen = []
    real = training.token_logprobs

    def spy(model, input_ids, *args, **kwargs):
        seen.append((int(input_ids.shape[0]), kwargs.get("shared_prefix", 0)))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(training, "token_logprobs", spy)
    model = {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}} if lora else {}
    shared, apart = make_engine(model=model), make_engine(model=model)
    a = shared.train_step(batch, GRPO, micro_batch_size=4)
    assert seen == [(3, 9), (3, 9)], "one micro-batch per question, its 9 prompt tokens shared"
    monkeypatch.setattr(batch_module, "MIN_SHARED_PREFIX", 10**6)
    seen.clear()
    b = apart.train_step(batch, GRPO, micro_batch_size=4)
    assert seen == [(4, 0), (2, 0)]
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    pa, pb = parameters(shared), parameters(apart)
    assert all(torch.allclose(pa[k], pb[k], atol=2e-5) for k in pa)  # Adam: see the test above


def test_an_optim_step_takes_its_own_adam_parameters_for_that_step_only(make_engine) -> None:
    """Tinker's optim_step carries AdamParams per step: each one given replaces the configured value
    for that step, and the next step without them is back on the configured optimizer."""
    from flywheel.trainer.types import AdamStep

    batch = make_batch()
    frozen = make_engine()  # configured lr 1e-3, weight decay 0.01
    before = parameters(frozen)
    frozen.forward_backward(batch, GRPO)
    result = frozen.optim_step(adam=AdamStep(learning_rate=0.0))
    assert result.learning_rate == 0.0 and result.step == 1
    assert same_tensors(parameters(frozen), before)  # lr 0: no update, no decay
    groups = frozen.policy.optimizer.param_groups
    assert all(g["lr"] == pytest.approx(1e-3) and g["betas"] == (0.9, 0.999) for g in groups)  # restored
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.01]
    frozen.forward_backward(batch, GRPO)
    assert frozen.optim_step().learning_rate == pytest.approx(1e-3)  # the configured one again
    assert not same_tensors(parameters(frozen), before)

    # Adam's first step moves each weight by about lr (lr * m / sqrt(v) = lr * sign(grad)).
    moved = {}
    for lr in (1e-2, 1e-4):
        engine = make_engine()
        start = parameters(engine)
        engine.forward_backward(batch, GRPO)
        engine.optim_step(adam=AdamStep(learning_rate=lr, weight_decay=0.0, beta1=0.5))
        moved[lr] = max(float((parameters(engine)[k] - start[k]).abs().max()) for k in start)
    assert moved[1e-2] == pytest.approx(1e-2, rel=0.05) and moved[1e-4] == pytest.approx(1e-4, rel=0.05)

    with pytest.raises(InvalidArgument, match=r"adam.beta1 must be in \[0, 1\)"):
        AdamStep(beta1=1.0)
    with pytest.raises(InvalidArgument, match="adam.learning_rate"):
        AdamStep(learning_rate=float("nan"))
