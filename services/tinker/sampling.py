"""The gateway's sampler: one rollout replica that serves the model's weights
as saved for sampling, and Tinker's sample requests translated to its Generate.

A save for the sampler exports the trainer's merged weights as a checkpoint
version (`sampler_dir/<model id>/version_N`) and installs it on the replica
at once (the trainer's weight version numbers them). A sampling session is
pinned to the version it was made for: a `snapshot` session samples exactly
that version, an `inflight` one that version or a newer one. The replica
holds one version, the newest saved: a snapshot whose version was replaced
is refused, naming both (serving several versions at once is not built yet).
When a new model takes the trainer, the replica starts over from the base
model (version 0), since that model's versions count from 0 again.
Installs wait for the samples running on the old version to finish, and
samples wait for an install in progress, so every sample comes from one
version, which is checked on the samples the replica returns.

Log-probs are of the distribution each token was drawn from (the rollout's
default: temperature, top-k and top-p applied); at temperature 1 without
top-k or top-p that is the model's, which forward() returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as tpb

from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.rollout.client import RolloutClient
from services.tinker import metrics

#: SampleRequest fields asking for what this sampler does not compute, with what "not asked" looks like.
_NOT_SERVED = {"prompt_logprobs": (None, False), "topk_prompt_logprobs": (0,), "topk_sample_logprobs": (0,),
               "target_prompt_logprobs": (None,), "prompt_alt_tokens_k": (0,), "prompt_logprobs_last_n": (None,),
               "record_stability_info": (None, False)}
_SAMPLE_FIELDS = {"num_samples", "prompt", "sampling_params", "base_model", "model_path", "sampling_session_id",
                  "seq_id", "type", *_NOT_SERVED}
_PARAMS = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
#: The replica's stop reasons -> Tinker's (an end-of-sequence token is a stop).
_STOP_REASONS = {common_pb2.FINISH_REASON_STOP: tpb.STOP_REASON_STOP, common_pb2.FINISH_REASON_LENGTH: tpb.STOP_REASON_LENGTH}


@dataclass(frozen=True)
class SamplePlan:
    """A Tinker sample request as the replica's Generate arguments."""

    prompt: list[int]
    num_samples: int
    params: dict[str, Any]


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
    return SamplePlan(_prompt_tokens(body.get("prompt")), n, params)


def sample_response(samples: list[common_pb2.Sample]) -> bytes:
    """The protobuf SampleResponse the SDK reads."""
    out = tpb.SampleResponse()
    for sample in samples:
        reason = _STOP_REASONS.get(sample.finish_reason)
        if reason is None:
            raise FailedPrecondition(f"the sampler ended a sample with "
                                     f"{common_pb2.FinishReason.Name(sample.finish_reason)}")
        out.sequences.add(stop_reason=reason,
                          tokens=np.asarray(sample.completion_token_ids, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(sample.completion_logprobs, dtype=np.float32).tobytes())
    return out.SerializeToString()


class Sampler:
    """The replica and the version it serves; installs and samples take turns (see the module doc)."""

    def __init__(self, rollout: RolloutClient, timeout: float) -> None:
        self.rollout = rollout
        self.timeout = timeout
        self.serving = 0
        self._running = 0  # samples in flight
        self._installing = False
        self._turns = asyncio.Condition()

    async def start(self) -> int:
        """The version the replica serves (a replica that answers is loaded: it serves after loading)."""
        self.serving = int((await self.rollout.status()).weight_version)
        metrics.SAMPLER_VERSION.set(self.serving)
        return self.serving

    async def install(self, version: int, checkpoint: str) -> None:
        """Serves `version` (the newest saved) from here on, once the samples running finish."""
        async with self._installing_turn():
            if version > self.serving:
                await self.rollout.update_weights(version, checkpoint=checkpoint, timeout_seconds=self.timeout)
                self.serving = version
                metrics.SAMPLER_VERSION.set(version)

    async def start_over(self) -> None:
        """Back to the base model as version 0 (a new model took the trainer: its versions count from 0
        again), once the samples running finish."""
        async with self._installing_turn():
            if self.serving != 0:
                await self.rollout.update_weights(0, start_over=True, timeout_seconds=self.timeout)
                self.serving = 0
                metrics.SAMPLER_VERSION.set(0)

    @contextlib.asynccontextmanager
    async def _installing_turn(self) -> AsyncIterator[None]:
        async with self._turns:
            await self._turns.wait_for(lambda: not self._installing)
            self._installing = True
            await self._turns.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self._turns:
                self._installing = False
                self._turns.notify_all()

    @contextlib.asynccontextmanager
    async def _sampling(self) -> AsyncIterator[None]:
        async with self._turns:
            await self._turns.wait_for(lambda: not self._installing)
            self._running += 1
        try:
            yield
        finally:
            async with self._turns:
                self._running -= 1
                self._turns.notify_all()

    async def sample(self, plan: SamplePlan, version: int, exact: bool) -> list[common_pb2.Sample]:
        async with self._sampling():
            if self.serving < version or (exact and self.serving != version):
                raise FailedPrecondition(
                    f"this sampling client's weights (version {version}) were replaced on the sampler by version "
                    f"{self.serving}; the gateway serves the newest weights saved for sampling only: "
                    "save again and sample with the new client"
                )
            [samples] = await self.rollout.generate([plan.prompt], timeout=self.timeout, **plan.params)
        served = {(s.weight_version_start, s.weight_version_end) for s in samples}
        if served != {(self.serving, self.serving)}:
            raise FailedPrecondition(f"the sampler answered with weight versions {sorted(served)}, "
                                     f"not {self.serving} throughout")
        return samples
