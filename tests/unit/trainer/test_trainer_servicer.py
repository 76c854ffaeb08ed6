"""The servicer's translation of protobuf, and GetInfo never waiting on training."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flywheel.errors import InvalidArgument
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.trainer.client import make_loss_spec, make_train_batch
from services.trainer.servicer import TrainerServicer, batch_tensors, loss_request
from tests.unit.trainer.trainer_helpers import make_batch


def test_batch_round_trip_is_bit_exact() -> None:
    batch = make_batch()
    decoded = batch_tensors(make_train_batch(**batch))
    assert decoded["old_logprobs"] is None and decoded["ref_logprobs"] is None
    for name, value in batch.items():
        assert decoded[name].dtype == value.dtype and torch.equal(decoded[name], value), name


def test_a_truncated_tensor_names_its_field() -> None:
    message = make_train_batch(**make_batch())
    message.loss_mask.data = message.loss_mask.data[:-4]
    with pytest.raises(InvalidArgument, match=r"^batch\.loss_mask: .*bytes"):
        batch_tensors(message)


def test_loss_spec_translation() -> None:
    request = loss_request(make_loss_spec("dapo", clip_high=0.3, aggregation="seq_mean_token_sum", is_cap=2.0))
    assert (request.kind, request.aggregation, request.is_cap) == ("dapo", "seq_mean_token_sum", 2.0)
    assert request.clip_high == pytest.approx(0.3)
    unset = loss_request(pb.LossSpec())
    assert unset.kind is None and unset.aggregation is None
    with pytest.raises(InvalidArgument, match=r"loss\.kind"):
        loss_request(pb.LossSpec(kind=42))
    with pytest.raises(ValueError):
        make_loss_spec("reinforce")


def test_dr_grpo_needs_its_constant_length() -> None:
    from services.trainer.config import LossConfig
    from services.trainer.loss_request import resolve_loss

    spec = pb.LossSpec(aggregation=pb.LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM, max_response_length=512)
    settings = resolve_loss(loss_request(spec), LossConfig())
    assert (settings.aggregation, settings.max_response_length) == ("seq_mean_token_sum_norm", 512)
    # Unset in the request: the trainer's configured length, else a clear error naming the field.
    unset = loss_request(pb.LossSpec(aggregation=pb.LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM))
    assert resolve_loss(unset, LossConfig(max_response_length=64)).max_response_length == 64
    with pytest.raises(InvalidArgument, match=r"loss\.max_response_length"):
        resolve_loss(unset, LossConfig())


def test_tinker_losses_resolve_to_a_sum_and_refuse_clip_settings_they_do_not_have() -> None:
    from services.trainer.config import LossConfig
    from services.trainer.loss_request import resolve_loss

    for kind in ("cross_entropy", "importance_sampling"):
        settings = resolve_loss(loss_request(make_loss_spec(kind)), LossConfig())
        assert (settings.kind, settings.aggregation) == (kind, "sum")
        for field in ("clip_low", "clip_high", "is_cap"):
            spec = make_loss_spec(kind)
            setattr(spec, field, 0.3)
            with pytest.raises(InvalidArgument, match=rf"loss\.{field}: {kind} has no clip"):
                resolve_loss(loss_request(spec), LossConfig())


def test_cispo_resolves_to_tinkers_sum_and_one_sided_clip_and_refuses_is_cap() -> None:
    from services.trainer.config import LossConfig
    from services.trainer.loss_request import resolve_loss

    request = loss_request(make_loss_spec("cispo"))
    assert request.kind == "cispo"
    # Unset: Tinker's [0, 4] on the ratio, whatever PPO clip the trainer is configured with.
    settings = resolve_loss(request, LossConfig(clip_low=0.3, clip_high=0.4))
    assert (settings.kind, settings.aggregation, settings.clip_low, settings.clip_high) == ("cispo", "sum", 1.0, 3.0)
    given = resolve_loss(loss_request(make_loss_spec("cispo", clip_low=0.1, clip_high=0.3)), LossConfig())
    assert (given.clip_low, given.clip_high) == pytest.approx((0.1, 0.3))
    with pytest.raises(InvalidArgument, match=r"loss\.is_cap: cispo takes no truncated importance weights"):
        resolve_loss(loss_request(make_loss_spec("cispo", is_cap=2.0)), LossConfig())


def test_clip_low_may_take_the_lower_bound_to_zero_and_no_further() -> None:
    """Tinker's clip_low_threshold 0 is clip_low 1 (no lower bound on the ratio); beyond 1 the bound
    would be negative."""
    from services.trainer.config import LossConfig
    from services.trainer.loss_request import resolve_loss

    for kind in ("ppo_clip", "cispo"):
        assert resolve_loss(loss_request(make_loss_spec(kind, clip_low=1.0)), LossConfig()).clip_low == 1.0
        with pytest.raises(InvalidArgument, match=r"loss\.clip_low: must be <= 1"):
            resolve_loss(loss_request(make_loss_spec(kind, clip_low=1.5)), LossConfig())
    with pytest.raises(InvalidArgument, match=r"loss\.clip_high: must be a finite number >= 0"):
        resolve_loss(loss_request(make_loss_spec("cispo", clip_high=-0.5)), LossConfig())


async def test_get_info_answers_while_a_training_call_holds_the_engine(make_engine) -> None:
    engine = make_engine()
    servicer = TrainerServicer(engine)
    request = pb.TrainStepRequest(batch=make_train_batch(**make_batch()), loss=make_loss_spec("grpo"))
    engine._lock.acquire()  # a long training step in progress
    try:
        step = asyncio.ensure_future(servicer.TrainStep(request, None))
        info = await asyncio.wait_for(servicer.GetInfo(pb.GetInfoRequest(), None), timeout=2)
        assert info.ready and info.step == 0
        await asyncio.sleep(0.2)
        assert not step.done()  # serialised behind the lock
    finally:
        engine._lock.release()
    response = await asyncio.wait_for(step, timeout=30)
    assert response.step == 1 and response.tokens == int(make_batch()["attention_mask"].sum())
    metrics = {m.name for m in response.metrics}
    assert {"loss", "clip_fraction", "approx_kl", "entropy", "grad_norm"} <= metrics


def test_adam_step_translation_keeps_unset_fields_unset() -> None:
    from flywheel.errors import InvalidArgument
    from flywheel.trainer.types import AdamStep
    from flywheel.trainer.v1 import trainer_pb2 as pb

    given = AdamStep(learning_rate=0.0, beta2=0.95)
    wire = pb.OptimStepRequest(adam=given.to_pb())
    assert wire.adam.HasField("learning_rate") and not wire.adam.HasField("beta1")  # 0.0 still travels
    assert AdamStep.from_pb(pb.OptimStepRequest.FromString(wire.SerializeToString()).adam) == given
    assert AdamStep.from_pb(pb.AdamStep()) == AdamStep()
    with pytest.raises(InvalidArgument, match="adam.eps must be > 0"):
        AdamStep.from_pb(pb.AdamStep(eps=0.0))
