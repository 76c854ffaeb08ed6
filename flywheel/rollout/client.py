"""Typed async client of the rollout service, for rollout workers and agents.

    async with RolloutClient("127.0.0.1:50053") as rollout:
        results = await rollout.generate(["What is 2 + 3?", [318, 268, 33]], max_tokens=64, temperature=1.0, n=4)
        for sample in results[0]:
            sample.completion_token_ids, sample.completion_logprobs, sample.weight_version_start
        await rollout.update_weights(7, checkpoint="/ckpt/global_step_7/model")
        (scores,) = await rollout.score([[318, 268, 33, 41]], top_logprobs=5)  # teacher log-probs of given ids

A prompt is token ids (list of ints), text (str) or chat messages (list of
OpenAI-style dicts). Every call has a deadline; failures raise
`flywheel.errors` exceptions carrying the gRPC status name in `code`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from flywheel import errors
from flywheel.common.types import pause_mode_to_pb
from flywheel.common.v1 import common_pb2
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import ChannelClient, domain_error, open_channel, translated
from flywheel.runtime.server_config import MIB

PromptLike = str | Sequence[int] | Sequence[dict[str, Any]]


def chat_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
                  add_generation_prompt: bool | None = None) -> pb.ChatMessages:
    return pb.ChatMessages(
        messages=[common_pb2.ChatMessage(
            role=m["role"], content=m.get("content") or "", name=m.get("name", ""),
            tool_call_id=m.get("tool_call_id", ""), tool_calls_json=[json.dumps(c) for c in m.get("tool_calls") or ()],
        ) for m in messages],
        tools_json=[json.dumps(t) for t in tools],
        add_generation_prompt=add_generation_prompt,
    )


def to_prompt(prompt: PromptLike, request_id: str = "") -> pb.Prompt:
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt, request_id=request_id)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        return pb.Prompt(messages=chat_messages(items), request_id=request_id)  # type: ignore[arg-type]
    return pb.Prompt(token_ids=pb.TokenIds(ids=items), request_id=request_id)  # type: ignore[arg-type]


class RolloutClient(ChannelClient):
    def __init__(self, address: str, *, token: str | None = None, timeout: float = 600.0,
                 max_message_bytes: int = 64 * MIB, max_attempts: int = 5) -> None:
        """`max_attempts`: transport retries of UNAVAILABLE (a caller that fails over to another
        replica wants few)."""
        self.address = address
        self.channel = open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes,
                                    max_attempts=max_attempts)
        self._stub = pb_grpc.RolloutServiceStub(self.channel)

    async def _call(self, what: str, rpc: Any, request: Any, timeout: float | None = None) -> Any:
        with translated(f"rollout {self.address} {what}"):
            return await rpc(request, timeout=timeout)

    async def generate(self, prompts: Sequence[PromptLike], *, request_ids: Sequence[str] = (),
                       timeout: float | None = None, run_step: int = 0, min_weight_version: int = 0,
                       adapter: pb.Adapter | None = None, **sampling: Any) -> list[list[common_pb2.Sample]]:
        """Samples per prompt, in order; `sampling` takes `SamplingParams` fields (max_tokens, n, ...).

        `run_step`: the train batch these are for (a replica counts its steps by it); `min_weight_version`:
        the least weight version to generate with; `adapter`: the LoRA adapter to sample with (GenerateRequest's
        fields)."""
        ids = list(request_ids) or [""] * len(prompts)
        if len(ids) != len(prompts):
            raise errors.InvalidArgument(f"request_ids: {len(ids)} ids for {len(prompts)} prompts")
        request = pb.GenerateRequest(prompts=[to_prompt(p, r) for p, r in zip(prompts, ids)],
                                     sampling=common_pb2.SamplingParams(**sampling), run_step=run_step,
                                     min_weight_version=min_weight_version, adapter=adapter)
        response = await self._call("Generate", self._stub.Generate, request, timeout)
        if len(response.results) != len(prompts):
            raise errors.InvalidArgument(f"rollout {self.address}: {len(response.results)} results for {len(prompts)} prompts")
        return [list(r.samples) for r in response.results]

    async def generate_stream(self, prompt: PromptLike, *, timeout: float | None = None,
                              **sampling: Any) -> AsyncIterator[pb.GenerateStreamResponse]:
        request = pb.GenerateStreamRequest(prompt=to_prompt(prompt), sampling=common_pb2.SamplingParams(**sampling))
        call = self._stub.GenerateStream(request, timeout=timeout)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc, f"rollout {self.address} GenerateStream") from None
        finally:
            call.cancel()

    async def score(self, sequences: Sequence[Sequence[int]], *, top_logprobs: int = 0, min_weight_version: int = 0,
                    timeout: float | None = None) -> list[pb.SequenceScore]:
        """Log-probs of given token ids under the served weights (a prefill; nothing is sampled): per
        sequence, `logprobs` (len(ids) - 1 of them: log p(ids[i + 1] | ids[:i + 1])), the `top_logprobs`
        most likely tokens per position and the `weight_version` that computed them."""
        request = pb.ScoreRequest(sequences=[pb.TokenIds(ids=list(ids)) for ids in sequences],
                                  top_logprobs=top_logprobs, min_weight_version=min_weight_version)
        response = await self._call("Score", self._stub.Score, request, timeout)
        if len(response.scores) != len(sequences):
            raise errors.DataLoss(f"rollout {self.address}: {len(response.scores)} scores for {len(sequences)} sequences")
        return list(response.scores)

    async def tokenize(self, prompt: str | Sequence[dict[str, Any]], *, add_special_tokens: bool = False,
                       add_generation_prompt: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            request = pb.TokenizeRequest(text=prompt, add_special_tokens=add_special_tokens)
        else:
            request = pb.TokenizeRequest(messages=chat_messages(prompt, add_generation_prompt=add_generation_prompt))
        return list((await self._call("Tokenize", self._stub.Tokenize, request, 30.0)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._call("Detokenize", self._stub.Detokenize, request, 30.0)).text

    async def status(self) -> pb.GetStatusResponse:
        return await self._call("GetStatus", self._stub.GetStatus, pb.GetStatusRequest(), 30.0)

    async def pause(self, mode: str = "abort") -> list[str]:
        """Pauses; returns the request ids aborted (mode abort) for the caller to retry."""
        response = await self._call("Pause", self._stub.Pause, pb.PauseRequest(mode=pause_mode_to_pb(mode)))
        return list(response.aborted_request_ids)

    async def resume(self) -> int:
        return (await self._call("Resume", self._stub.Resume, pb.ResumeRequest())).weight_version

    async def update_weights(self, version: int, *, checkpoint: str | None = None, memory: bool = False,
                             nccl: pb.NcclSource | None = None, start_over: bool = False,
                             pause_mode: str | None = None, timeout_seconds: float = 0.0) -> pb.UpdateWeightsResponse:
        """Moves to `version` (the operator's path) from a checkpoint directory, the replica's own
        synchronizer (`memory`) or an NCCL group of that synchronizer's: exactly one. `start_over`:
        back to the base model as version 0 (give version 0 and no source), a new lineage of weights."""
        if sum((checkpoint is not None, memory, nccl is not None, start_over)) != 1:
            raise errors.InvalidArgument("update_weights: give exactly one of checkpoint, memory, nccl or start_over")
        request = pb.UpdateWeightsRequest(version=version, pause_mode=pause_mode_to_pb(pause_mode),
                                          timeout_seconds=timeout_seconds, start_over=start_over)
        if start_over:
            pass  # the base model: no source
        elif checkpoint is not None:
            request.checkpoint.path = checkpoint
        elif nccl is not None:
            request.nccl.CopyFrom(nccl)
        else:
            request.memory.SetInParent()
        deadline = (timeout_seconds or 300.0) + 60.0
        return await self._call("UpdateWeights", self._stub.UpdateWeights, request, deadline)
