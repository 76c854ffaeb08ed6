"""gRPC servicer of the rollout service: translates protobuf to the domain
(`services.rollout.serving.core`) and back; no engine or update logic lives here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from flywheel.codec.dtypes import tensor_to_proto
from flywheel.common.types import finish_reason_to_pb, pause_mode_from_pb
from flywheel.common.v1 import common_pb2
from flywheel.errors import InvalidArgument
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.runtime.addresses import check_address
from flywheel.synchronizer.types import Method
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import PauseMode, SampleOutput
from services.rollout.serving import sampling as sampling_mod
from services.rollout.serving.adapters import AdapterRef
from services.rollout.serving.core import QueueFull, RolloutCore
from services.rollout.serving.prompts import (
    ChatPrompt, PromptInput, TextPrompt, TokenPrompt, check_token_ids, validate_messages, validate_tools,
)
from services.rollout.weights.arrival import (
    FromBaseModel, FromCheckpoint, FromGroup, FromSynchronizer, Source, WeightArrival,
)
from services.rollout.weights.nccl import NcclTarget
from services.rollout.weights.transaction import UpdateResult


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{field}: not valid JSON: {exc}") from None


def _at(field: str) -> str:
    return f"{field}." if field else ""


def chat_from_proto(chat: pb.ChatMessages, field: str) -> ChatPrompt:
    messages = []
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls_json:
            message["tool_calls"] = [_json(t, f"{_at(field)}messages[{i}].tool_calls_json[{j}]") for j, t in enumerate(m.tool_calls_json)]
        messages.append(message)
    tools = [_json(t, f"{_at(field)}tools_json[{j}]") for j, t in enumerate(chat.tools_json)] or None
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return ChatPrompt(messages=messages, tools=tools, add_generation_prompt=add)


def prompt_from_proto(prompt: pb.Prompt, field: str) -> PromptInput:
    kind = prompt.WhichOneof("content")
    if kind == "token_ids":
        return TokenPrompt(list(prompt.token_ids.ids))
    if kind == "text":
        return TextPrompt(prompt.text)
    if kind == "messages":
        return chat_from_proto(prompt.messages, field)
    raise InvalidArgument(f"{field}: set one of token_ids, text or messages")


def sample_to_proto(sample: SampleOutput, prompt_ids: list[int]) -> common_pb2.Sample:
    return common_pb2.Sample(
        prompt_token_ids=prompt_ids,
        completion_token_ids=sample.token_ids,
        completion_logprobs=sample.logprobs,
        finish_reason=finish_reason_to_pb(sample.finish_reason),
        stop_reason=sample.stop_reason,
        weight_version_start=sample.version_start,
        weight_version_end=sample.version_end,
        text=sample.text,
        top_logprobs=[common_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
                      for top in sample.top_logprobs],
        index=sample.index,
        logprobs_distribution=sample.distribution.to_pb(),
        prompt_logprobs=sample.prompt_logprobs,
        weight_version_spans=[common_pb2.VersionSpan(version=s.version, start=s.start, end=s.end)
                              for s in sample.version_spans],
        kept_sets=[common_pb2.KeptSet(position=k.position, size=k.size, token_ids=k.token_ids,
                                      constrained=k.constrained) for k in sample.kept_sets],
        routed_experts=None if sample.routed_experts is None else tensor_to_proto(sample.routed_experts),
        adapter_identity=sample.adapter_identity,
    )


class RolloutServicer:
    def __init__(self, config: RolloutConfig, core: RolloutCore, arrival: WeightArrival,
                 http_port: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.core = core
        self.arrival = arrival
        self._http_port = http_port

    def _spec(self, request: Any) -> Any:
        return sampling_mod.from_proto(request.sampling, max_top_logprobs=self.config.limits.max_top_logprobs)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        limit = self.config.limits.max_prompts_per_request
        if not request.prompts:
            raise InvalidArgument("prompts: at least one prompt is needed")
        if len(request.prompts) > limit:
            raise InvalidArgument(f"prompts: at most {limit} prompts per request, got {len(request.prompts)}")
        spec = self._spec(request)
        prompts = [self.core.resolve(prompt_from_proto(p, f"prompts[{i}]"), f"prompts[{i}]", p.request_id)
                   for i, p in enumerate(request.prompts)]
        adapter = AdapterRef(request.adapter.path, request.adapter.identity) if request.HasField("adapter") else None
        outputs = await _with_retry_hint(context, self.core.generate(
            prompts, spec, run_step=request.run_step, min_version=request.min_weight_version, adapter=adapter))
        return pb.GenerateResponse(results=[
            pb.PromptResult(request_id=o.request_id, samples=[sample_to_proto(s, o.prompt_ids) for s in o.samples])
            for o in outputs
        ])

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateStreamResponse]:
        spec = self._spec(request)
        prompt = self.core.resolve(prompt_from_proto(request.prompt, "prompt"), "prompt", request.prompt.request_id)
        try:
            async for deltas in self.core.generate_stream(
                    prompt, spec, run_step=request.run_step, min_version=request.min_weight_version):
                for d in deltas:
                    yield pb.GenerateStreamResponse(
                        index=d.index, token_ids=d.token_ids, logprobs=d.logprobs, text=d.text,
                        final=sample_to_proto(d.final, prompt.ids) if d.final is not None else None,
                    )
        except QueueFull as exc:
            _set_retry_hint(context, exc)
            raise

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        scores = await _with_retry_hint(context, self.core.score(
            [s.ids for s in request.sequences], request.top_logprobs, min_version=request.min_weight_version))
        return pb.ScoreResponse(scores=[pb.SequenceScore(
            logprobs=s.logprobs, weight_version=s.version,
            top_logprobs=[common_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
                          for top in s.top_logprobs],
        ) for s in scores])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        _, codec = self.core.require_engine()
        kind = request.WhichOneof("content")
        if kind == "text":
            ids = codec.encode(request.text, add_special_tokens=request.add_special_tokens)
        elif kind == "messages":
            chat = chat_from_proto(request.messages, "")
            ids = codec.encode_chat(validate_messages(chat.messages), tools=validate_tools(chat.tools),
                                    add_generation_prompt=chat.add_generation_prompt)
        else:
            raise InvalidArgument("content: set text or messages")
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        engine, codec = self.core.require_engine()
        check_token_ids(request.token_ids, engine.vocab_size, "token_ids")
        return pb.DetokenizeResponse(text=codec.decode(list(request.token_ids), skip_special_tokens=request.skip_special_tokens))

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        s = self.core.status()
        return pb.GetStatusResponse(
            model_name=s.model_name, weight_version=s.version, running_requests=s.running, waiting_requests=s.waiting,
            kv_cache_usage_ratio=s.kv_cache_usage, paused=s.paused, engine=s.engine, updating=s.updating,
            http_port=self._http_port(), max_model_len=s.max_model_len,
            max_resident_adapters=self.config.adapters.max_resident if self.core.adapters_served() else 0,
        )

    def _mode(self, mode: int, field: str) -> PauseMode:
        try:
            name = pause_mode_from_pb(mode)
        except ValueError:
            raise InvalidArgument(f"{field}: unknown pause mode {mode}") from None
        return name or self.config.updates.default_pause_mode  # type: ignore[return-value]

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext) -> pb.PauseResponse:
        aborted, version = await self.core.pause(self._mode(request.mode, "mode"))
        return pb.PauseResponse(aborted_request_ids=aborted, weight_version=version)

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.ResumeResponse:
        return pb.ResumeResponse(weight_version=await self.core.resume())

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        if request.start_over:
            if request.version != 0 or request.WhichOneof("source") is not None:
                raise InvalidArgument("start_over: the base model is version 0 from engine.model_path; give no "
                                      "version and no source")
        elif request.version < 1:
            raise InvalidArgument("version: must be >= 1")
        if not request.timeout_seconds >= 0:
            raise InvalidArgument("timeout_seconds: must be >= 0")
        source = self._source(request)
        mode = self._mode(request.pause_mode, "pause_mode")
        # Back to the base model is a new lineage of weights (UpdateWeightsRequest.start_over).
        return _update_response(await self.arrival.install(
            request.version, source, mode=mode, timeout=request.timeout_seconds or None,
            rewind=request.start_over))

    def _source(self, request: pb.UpdateWeightsRequest) -> Source:
        if request.start_over:
            return FromBaseModel()
        kind = request.WhichOneof("source")
        if kind is None:
            raise InvalidArgument("source: set memory, checkpoint or nccl")
        if request.method not in (common_pb2.SYNC_METHOD_UNSPECIFIED, int(Method[kind.upper()])):
            raise InvalidArgument(f"method: {common_pb2.SyncMethod.Name(request.method)} does not match source {kind}")
        if kind == "nccl":
            return FromGroup(_nccl_target(request.nccl, self.config.synchronizer.address))
        if kind == "checkpoint":
            if not request.checkpoint.path:
                raise InvalidArgument("checkpoint.path: empty")
            return FromCheckpoint(request.checkpoint.path)
        return FromSynchronizer()


def _nccl_target(nccl: pb.NcclSource, synchronizer: str) -> NcclTarget:
    if not nccl.group_id:
        raise InvalidArgument("nccl.group_id: empty")
    if nccl.rendezvous_address:
        check_address(nccl.rendezvous_address, "nccl.rendezvous_address")
    return NcclTarget(group_id=nccl.group_id, synchronizer_address=synchronizer, rank=nccl.rank,
                      rendezvous_address=nccl.rendezvous_address, world_size=nccl.world_size, backend=nccl.backend)


def _update_response(outcome: UpdateResult) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(weight_version=outcome.version, pause_seconds=outcome.pause_seconds,
                                    bytes=outcome.nbytes, aborted_request_ids=outcome.aborted_request_ids)


def _set_retry_hint(context: grpc.aio.ServicerContext, exc: QueueFull) -> None:
    context.set_trailing_metadata((("retry-after-ms", str(int(exc.retry_after_seconds * 1000))),))


async def _with_retry_hint(context: grpc.aio.ServicerContext, coro: Any) -> Any:
    try:
        return await coro
    except QueueFull as exc:
        _set_retry_hint(context, exc)
        raise
