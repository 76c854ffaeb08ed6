"""Tinker's sample requests translated to the rollout's Generate, and its samples
back to the SDK's SampleResponse (the replica and the versions it serves:
services/tinker/sampler.py).

Log-probs are of the distribution each token was drawn from (the rollout's
default: temperature, top-k and top-p applied); at temperature 1 without
top-k or top-p that is the model's, which forward() returns. Prompt log-probs
(`prompt_logprobs`, what `compute_logprobs` asks) are always the model's own:
the rollout's Generate scores the prompt in the sample's prefill
(`SamplingParams.prompt_logprobs`); `prompt_logprobs_last_n` only hides the
positions before the last N (the whole prompt is computed all the same).
Top-k log-probs of the sampled tokens (`topk_sample_logprobs`) are the
rollout's `top_logprobs`, of the sampled log-probs' distribution: tokens it
cannot draw are left out, their cells the SDK's empty ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as tpb
from tinker.types.topk_logprobs import MASK_LOGPROB

from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument

#: SampleRequest fields asking for what this sampler does not compute, with what "not asked" looks like.
_NOT_SERVED = {"topk_prompt_logprobs": (0,), "target_prompt_logprobs": (None,), "prompt_alt_tokens_k": (0,),
               "record_stability_info": (None, False)}
_SAMPLE_FIELDS = {"num_samples", "prompt", "sampling_params", "base_model", "model_path", "sampling_session_id",
                  "seq_id", "type", "prompt_logprobs", "prompt_logprobs_last_n", "topk_sample_logprobs", *_NOT_SERVED}
_PARAMS = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
#: The replica's stop reasons -> Tinker's (an end-of-sequence token is a stop).
_STOP_REASONS = {common_pb2.FINISH_REASON_STOP: tpb.STOP_REASON_STOP, common_pb2.FINISH_REASON_LENGTH: tpb.STOP_REASON_LENGTH}


@dataclass(frozen=True)
class SamplePlan:
    """A Tinker sample request as the replica's Generate arguments."""

    prompt: list[int]
    num_samples: int
    params: dict[str, Any]
    #: Score the prompt (SampleResponse.prompt_logprobs): only its last N positions when set.
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    #: The most likely tokens per sampled position (SampledSequence.topk_sampled_logprobs); 0: none.
    topk_sample_logprobs: int = 0


def _prompt_tokens(prompt: Any) -> list[int]:
    chunks = prompt.get("chunks") if isinstance(prompt, Mapping) else None
    if not isinstance(chunks, list) or not chunks:
        raise InvalidArgument("prompt.chunks: a list of encoded_text chunks is needed")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
        if kind != "encoded_text":
            raise InvalidArgument(f"prompt.chunks[{i}]: {kind} chunks are not served (text models only)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgument(f"prompt.chunks[{i}].tokens: a list of token ids is needed")
        tokens += ids
    if not tokens:
        raise InvalidArgument("prompt: no tokens")
    return tokens


def sample_plan(body: Mapping[str, Any]) -> SamplePlan:
    """The Generate arguments of an asample request; anything it asks that is not served is refused by name."""
    unknown = sorted(set(body) - _SAMPLE_FIELDS)
    if unknown:
        raise InvalidArgument(f"asample: {unknown[0]} is not served by this gateway")
    for name, absent in _NOT_SERVED.items():
        if body.get(name, absent[0]) not in absent:
            raise InvalidArgument(f"asample: {name} is not served by this gateway")
    n = body.get("num_samples", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
        raise InvalidArgument(f"num_samples must be 1..256, got {n!r}")
    given = body.get("sampling_params")
    if not isinstance(given, Mapping):
        raise InvalidArgument("sampling_params: an object is needed")
    unknown = sorted(set(given) - _PARAMS)
    if unknown:
        raise InvalidArgument(f"sampling_params.{unknown[0]} is not served by this gateway")
    max_tokens = given.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidArgument(f"sampling_params.max_tokens: a positive limit is needed here, got {max_tokens!r}")
    params: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "temperature": float(given.get("temperature", 1.0)),
                              "top_p": float(given.get("top_p", 1.0)), "top_k": int(given.get("top_k", -1))}
    if given.get("seed") is not None:
        params["seed"] = int(given["seed"]) % (2**63 - 1)
    stop = given.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, list):
        if not stop:
            params["ignore_eos"] = True  # Tinker: [] turns every stop off, end-of-sequence included
        elif all(isinstance(s, str) for s in stop):
            params["stop"] = stop
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            params["stop_token_ids"] = stop
        else:
            raise InvalidArgument("sampling_params.stop: strings or token ids, not both")
    elif stop is not None:
        raise InvalidArgument(f"sampling_params.stop: a string or a list, got {stop!r}")
    prompt = _prompt_tokens(body.get("prompt"))
    scored = body.get("prompt_logprobs")
    if scored not in (None, False, True):
        raise InvalidArgument(f"prompt_logprobs: true or false, got {scored!r}")
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not scored:
            raise InvalidArgument("prompt_logprobs_last_n: applies to prompt log-probs; set prompt_logprobs")
        if not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= len(prompt) - 1:
            raise InvalidArgument(f"prompt_logprobs_last_n must be 1..{len(prompt) - 1} (the prompt's length - 1), "
                                  f"got {last_n!r}")
    if scored:
        params["prompt_logprobs"] = True
    k = body.get("topk_sample_logprobs", 0)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidArgument(f"topk_sample_logprobs: a number of tokens (0: none), got {k!r}")
    if k:
        params["top_logprobs"] = k  # at most the rollout's limits.max_top_logprobs (20 by default)
    return SamplePlan(prompt, n, params, prompt_logprobs=bool(scored), prompt_logprobs_last_n=last_n,
                      topk_sample_logprobs=k)


def _prompt_logprobs(sample: common_pb2.Sample, plan: SamplePlan) -> bytes:
    """float32 per prompt token, NaN where none is given: the first token (no context), and the tokens before the
    last N with prompt_logprobs_last_n."""
    scored = np.full(len(plan.prompt), np.nan, dtype=np.float32)
    if len(sample.prompt_logprobs) != len(plan.prompt) - 1:
        raise FailedPrecondition(f"the sampler scored {len(sample.prompt_logprobs)} prompt tokens, not "
                                 f"{len(plan.prompt) - 1} (all but the first)")
    scored[1:] = sample.prompt_logprobs
    if plan.prompt_logprobs_last_n is not None:
        scored[:len(plan.prompt) - plan.prompt_logprobs_last_n] = np.nan
    return scored.tobytes()


def _topk(sample: common_pb2.Sample, k: int) -> tpb.TopkLogprobs:
    """The sample's top_logprobs as the SDK's dense N x k matrices, a short row (the sampling distribution
    keeps fewer than k tokens) padded with the SDK's empty cell (token 0, MASK_LOGPROB)."""
    rows = sample.top_logprobs
    if len(rows) != len(sample.completion_token_ids):
        raise FailedPrecondition(f"the sampler gave top log-probs for {len(rows)} of "
                                 f"{len(sample.completion_token_ids)} sampled tokens")
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        width = min(k, len(row.token_ids))
        ids[i, :width] = row.token_ids[:width]
        logprobs[i, :width] = row.logprobs[:width]
    return tpb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


def sample_response(samples: list[common_pb2.Sample], plan: SamplePlan) -> bytes:
    """The protobuf SampleResponse the SDK reads, for the samples of `plan`."""
    out = tpb.SampleResponse()
    if plan.prompt_logprobs and samples:
        out.prompt_logprobs = _prompt_logprobs(samples[0], plan)
    for sample in samples:
        reason = _STOP_REASONS.get(sample.finish_reason)
        if reason is None:
            raise FailedPrecondition(f"the sampler ended a sample with "
                                     f"{common_pb2.FinishReason.Name(sample.finish_reason)}")
        sequence = out.sequences.add(stop_reason=reason,
                                     tokens=np.asarray(sample.completion_token_ids, dtype=np.int32).tobytes(),
                                     logprobs=np.asarray(sample.completion_logprobs, dtype=np.float32).tobytes())
        if plan.topk_sample_logprobs:
            sequence.topk_sampled_logprobs.CopyFrom(_topk(sample, plan.topk_sample_logprobs))
    return out.SerializeToString()
