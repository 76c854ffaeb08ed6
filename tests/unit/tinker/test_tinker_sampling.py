"""The gateway's sample requests as the SDK builds them, and its responses as the SDK decodes them."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument
from services.tinker.sampling import sample_plan, sample_response

PROMPT = [5, 6, 7, 8]


def body(**fields) -> dict:
    """A SampleRequest as the SDK sends it."""
    request = types.SampleRequest(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                  sampling_params=types.SamplingParams(max_tokens=1), **fields)
    return request.model_dump(mode="json")


def sample(**fields) -> common_pb2.Sample:
    return common_pb2.Sample(prompt_token_ids=PROMPT, completion_token_ids=[9], completion_logprobs=[-0.5],
                             finish_reason=common_pb2.FINISH_REASON_LENGTH, **fields)


def test_prompt_log_probs_are_asked_of_the_rollout_and_come_back_with_none_first() -> None:
    plan = sample_plan(body(prompt_logprobs=True))
    assert plan.params["prompt_logprobs"] is True
    got = deserialize_sample_response(sample_response([sample(prompt_logprobs=[-1, -2, -3])], plan))
    assert got.prompt_logprobs == [None, -1.0, -2.0, -3.0]
    # The last N only: the positions before them are None (the whole prompt is scored all the same).
    plan = sample_plan(body(prompt_logprobs=True, prompt_logprobs_last_n=2))
    got = deserialize_sample_response(sample_response([sample(prompt_logprobs=[-1, -2, -3])], plan))
    assert got.prompt_logprobs == [None, None, -2.0, -3.0]
    # Not asked: not asked of the rollout, and none in the response.
    plan = sample_plan(body(prompt_logprobs=False))
    assert "prompt_logprobs" not in plan.params
    assert deserialize_sample_response(sample_response([sample()], plan)).prompt_logprobs is None


def test_top_k_of_the_sampled_tokens_are_the_rollouts_alternatives_in_the_sdks_matrices() -> None:
    plan = sample_plan(body(topk_sample_logprobs=3))
    assert plan.params["top_logprobs"] == 3
    rows = [common_pb2.TopLogprobs(token_ids=[9, 4, 2], logprobs=[-0.5, -1.5, -2.0]),
            common_pb2.TopLogprobs(token_ids=[3], logprobs=[-0.1])]  # a distribution that keeps one token
    two = common_pb2.Sample(prompt_token_ids=PROMPT, completion_token_ids=[9, 3], completion_logprobs=[-0.5, -0.1],
                            finish_reason=common_pb2.FINISH_REASON_STOP, top_logprobs=rows)
    (sequence,) = deserialize_sample_response(sample_response([two], plan)).sequences
    assert sequence.topk_logprobs == [[(9, -0.5), (4, -1.5), (2, -2.0)], [(3, pytest.approx(-0.1))]]
    assert sequence.topk_logprobs_np.token_ids.shape == (2, 3)
    # Not asked: none.
    (sequence,) = deserialize_sample_response(sample_response([sample()], sample_plan(body()))).sequences
    assert sequence.topk_logprobs is None
    with pytest.raises(FailedPrecondition, match="top log-probs for 0 of 1 sampled tokens"):
        sample_response([sample()], plan)


def test_what_cannot_be_served_is_refused_by_name() -> None:
    for fields, message in (({"prompt_logprobs_last_n": 2}, "set prompt_logprobs"),
                            ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, r"must be 1\.\.3"),
                            ({"topk_prompt_logprobs": 2}, "topk_prompt_logprobs is not served"),
                            ({"topk_sample_logprobs": -1}, "topk_sample_logprobs: a number of tokens"),
                            ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not served")):
        with pytest.raises(InvalidArgument, match=message):
            sample_plan(body(**fields))
    plan = sample_plan(body(prompt_logprobs=True))
    with pytest.raises(FailedPrecondition, match="scored 1 prompt tokens, not 3"):
        sample_response([sample(prompt_logprobs=[-1.0])], plan)
