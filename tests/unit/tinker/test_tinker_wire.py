"""The Tinker wire formats against the SDK's own encoders and decoders: a
datum becomes the trainer's next-token batch, the result decodes in the SDK."""

from __future__ import annotations

import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from flywheel.codec.dtypes import tensor_from_proto
from flywheel.errors import InvalidArgument
from flywheel.trainer.client import ForwardBackwardResult
from flywheel.trainer.types import AdamStep
from flywheel.trainer.v1 import trainer_pb2
from services.tinker.wire import adam_step, forward_backward_output, parse_forward_backward, trainer_call


def datum(tokens: list[int], weights: list[float] | None = None, **inputs) -> types.Datum:
    targets = tokens[1:] + [inputs.pop("last", 99)]
    loss_inputs = {"target_tokens": targets, **inputs}
    if weights is not None:
        loss_inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_inputs)


def request(data, loss="cross_entropy", config=None, forward_only=False):
    message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="m", seq_id=1))
    message.forward_only = forward_only
    return parse_forward_backward(message.SerializeToString())


def test_a_datum_becomes_its_input_and_last_target_with_weights_at_the_target_positions() -> None:
    call = trainer_call(request([datum([5, 6, 7], [0.0, 1.0, -2.0], last=8), datum([9, 10], [1.0, 1.0], last=11)]))
    batch = call.batch
    ids, mask = tensor_from_proto(batch.input_ids), tensor_from_proto(batch.loss_mask)
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert tensor_from_proto(batch.attention_mask).tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mask.tolist() == [[False, True, True, True], [False, True, True, False]]  # every target, weight 0 too
    assert tensor_from_proto(batch.advantages).tolist() == [[0, 0, 1, -2], [0, 1, 1, 0]]
    assert not batch.HasField("behaviour_logprobs")
    assert call.lengths == [3, 2] and call.loss.kind == trainer_pb2.LOSS_KIND_CROSS_ENTROPY and not call.forward_only


#: An RL datum: the sampler's log-probs and the advantages at 3 target positions.
RL = datum([1, 2, 3], logprobs=[-1.0, -2.0, -3.0], advantages=[0.0, 0.5, -0.5])


def test_importance_sampling_carries_the_samplers_logprobs_and_the_advantages() -> None:
    call = trainer_call(request([datum([1, 2, 3], logprobs=[-1.0, -2.0, -3.0], advantages=[0.0, 0.5, 0.5])],
                                loss="importance_sampling", forward_only=True))
    assert tensor_from_proto(call.batch.behaviour_logprobs).tolist() == [[0, -1, -2, -3]]
    assert tensor_from_proto(call.batch.advantages).tolist() == [[0, 0, 0.5, 0.5]]
    assert call.loss.kind == trainer_pb2.LOSS_KIND_IMPORTANCE_SAMPLING and call.forward_only
    assert call.loss.aggregation == trainer_pb2.LOSS_AGGREGATION_SUM  # said, not left to the trainer's config


@pytest.mark.parametrize("loss, config, kind, clip", [
    ("ppo", None, trainer_pb2.LOSS_KIND_PPO_CLIP, (0.2, 0.2)),  # Tinker's defaults: [0.8, 1.2] on the ratio
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}, trainer_pb2.LOSS_KIND_PPO_CLIP, (0.1, 0.3)),
    ("ppo", {"clip_low_threshold": 0.0}, trainer_pb2.LOSS_KIND_PPO_CLIP, (1.0, 0.2)),  # no lower bound
    ("cispo", None, trainer_pb2.LOSS_KIND_CISPO, (1.0, 3.0)),  # one-sided: [0, 4]
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2}, trainer_pb2.LOSS_KIND_CISPO, (0.5, 1.0)),
])
def test_ppo_and_cispo_carry_their_thresholds_as_the_trainers_clip_with_the_sum(loss, config, kind, clip) -> None:
    call = trainer_call(request([RL], loss=loss, config=config))
    assert tensor_from_proto(call.batch.behaviour_logprobs).tolist() == [[0, -1, -2, -3]]
    assert tensor_from_proto(call.batch.advantages).tolist() == [[0, 0, 0.5, -0.5]]
    assert call.loss.kind == kind and call.loss.aggregation == trainer_pb2.LOSS_AGGREGATION_SUM
    assert (call.loss.clip_low, call.loss.clip_high) == pytest.approx(clip)
    assert (call.loss.is_cap, call.loss.kl_coef, call.loss.entropy_coef) == (0, 0, 0)


def test_a_setting_in_the_sdks_v2_map_wins_over_its_legacy_copy() -> None:
    """The SDK writes each number to both maps and says servers prefer v2; an older SDK writes the
    legacy map alone."""
    message = request([RL], loss="ppo", config={"clip_high_threshold": 1.5})
    message.loss_fn_config["clip_high_threshold"] = 3.0
    message.loss_fn_config["clip_low_threshold"] = 0.5  # legacy only
    call = trainer_call(message)
    assert (call.loss.clip_low, call.loss.clip_high) == pytest.approx((0.5, 0.5))


@pytest.mark.parametrize("loss, data, config, message", [
    ("dro", [datum([1, 2], [1.0, 1.0])], None, "loss_fn 'dro' is not served"),
    ("gspo", [datum([1, 2], [1.0, 1.0])], None, "loss_fn 'gspo' is not served"),
    ("cross_entropy", [datum([1, 2], [1.0, 1.0])], {"clip_low_threshold": 0.8}, "takes no settings here; got clip"),
    ("importance_sampling", [RL], {"clip_high_threshold": 1.2}, "importance_sampling takes no settings here"),
    ("ppo", [RL], {"clip_low_threshold": 0.8, "kl_coeff": 0.1, "beta": 1.0},
     "loss_fn_config: beta, kl_coeff not served for ppo; it takes clip_low_threshold and clip_high_threshold"),
    ("cispo", [RL], {"clip_ratio": 2.0}, "clip_ratio not served for cispo"),
    ("ppo", [RL], {"clip_low_threshold": "tight"}, r"loss_fn_config\.clip_low_threshold: must be a number, got 'tight'"),
    ("ppo", [RL], {"clip_low_threshold": 1.0}, r"clip_low_threshold: must be in \[0, 1\)"),
    ("cispo", [RL], {"clip_low_threshold": -0.1}, r"clip_low_threshold: must be in \[0, 1\)"),
    ("ppo", [RL], {"clip_high_threshold": 1.0}, r"clip_high_threshold: must be a finite number > 1, got 1.0"),
    ("cispo", [RL], {"clip_high_threshold": float("inf")}, "clip_high_threshold: must be a finite number > 1"),
    ("ppo", [datum([1, 2], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0], clip_low_threshold=[0.5, 0.5])], None,
     "clip_low_threshold not read by ppo"),  # per-token thresholds: only loss_fn_config's are served
    ("cispo", [datum([1, 2], advantages=[1.0, 1.0])], None, "cispo needs logprobs"),
    ("cross_entropy", [datum([1, 2])], None, "cross_entropy needs weights"),
    ("cross_entropy", [datum([1, 2], [1.0, 1.0], advantages=[1.0, 1.0])], None, "advantages not read by"),
    ("importance_sampling", [datum([1, 2], advantages=[1.0, 1.0])], None, "needs logprobs"),
    ("cross_entropy", [datum([1, 2, 3], [1.0, 1.0])], None, "weights: 2 values for 3 positions"),
])
def test_what_a_loss_does_not_read_or_lacks_is_refused_by_name(loss, data, config, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        trainer_call(request(data, loss=loss, config=config))


def test_targets_that_are_not_the_shifted_input_are_refused_at_the_first_difference() -> None:
    odd = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": [2, 4, 5], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(InvalidArgument, match=r"target_tokens\[1\] = 4 is not model_input\[2\] = 3"):
        trainer_call(request([odd]))


def test_the_result_decodes_in_the_sdk_as_each_datums_target_logprobs_and_the_summed_loss() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -4.0, -5.0, 0.0]])
    body = forward_backward_output(ForwardBackwardResult(5, {"loss": 7.5}, logprobs), [3, 2])
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 7.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-4.0, -5.0]]
    assert all(o["logprobs"].dtype == "float32" for o in out.loss_fn_outputs)


def test_an_optim_step_takes_adam_parameters_only() -> None:
    body = types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=3e-4, grad_clip_norm=1.0),
                                  model_id="m", seq_id=2).model_dump(mode="json", exclude_none=True)
    adam = adam_step(body)
    assert (adam.learning_rate, adam.max_grad_norm, adam.beta2, adam.eps) == (3e-4, 1.0, 0.95, 1e-12)
    with pytest.raises(InvalidArgument, match="only Adam steps"):
        adam_step({"optimizer_params": {"type": "dimuon", "learning_rate": 0.1}})
    with pytest.raises(InvalidArgument, match="adam_params.momentum is not an Adam parameter"):
        adam_step({"adam_params": {"momentum": 0.9}})
    with pytest.raises(InvalidArgument, match="beta1 must be in"):
        adam_step({"adam_params": {"beta1": 1.5}})
    assert adam_step({"adam_params": {}}) == AdamStep()  # nothing given: the trainer's own, field by field


def test_a_body_that_is_not_the_sdks_protobuf_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="not a tinker ForwardBackwardRequest"):
        parse_forward_backward(b'{"model_id": "m"}')
