"""A rollout service behind the controller's `RolloutEngine` protocol.

Prompts go out as token ids, text or chat messages; samples come back with
their token ids, log-probs, finish reason and start/end weight versions.
Weight updates name their source by method (memory: the synchronizer;
checkpoint: a directory; nccl: the group, this replica's rank in it and the
synchronizer that allocated it).
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import InvalidArgument
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from flywheel.runtime.client import translated
from services.controller.adapters.trainer import sync_method
from services.controller.domain import (
    MIN_WEIGHT_VERSION,
    RUN_STEP,
    FinishReason,
    Generation,
    PromptInput,
    SamplingSpec,
    WeightSource,
)

FINISH = {
    cpb.FINISH_REASON_STOP: FinishReason.STOP,
    cpb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    cpb.FINISH_REASON_ABORT: FinishReason.ABORT,
    cpb.FINISH_REASON_ERROR: FinishReason.ERROR,
}
PAUSE = {"abort": pb.PAUSE_MODE_ABORT, "wait": pb.PAUSE_MODE_WAIT, "keep": pb.PAUSE_MODE_KEEP}


def chat_messages(messages: Sequence[dict], add_generation_prompt: bool | None = None) -> pb.ChatMessages:
    return pb.ChatMessages(
        messages=[
            cpb.ChatMessage(
                role=m["role"], content=m.get("content") or "", name=m.get("name", ""),
                tool_call_id=m.get("tool_call_id", ""),
            )
            for m in messages
        ],
        add_generation_prompt=add_generation_prompt,
    )


def prompt(p: PromptInput) -> pb.Prompt:
    if p.token_ids is not None:
        return pb.Prompt(token_ids=pb.TokenIds(ids=p.token_ids), request_id=p.request_id)
    if p.messages is not None:
        return pb.Prompt(messages=chat_messages(p.messages), request_id=p.request_id)
    return pb.Prompt(text=p.text or "", request_id=p.request_id)


def sampling_params(s: SamplingSpec) -> cpb.SamplingParams:
    return cpb.SamplingParams(
        n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        stop=list(s.stop), seed=s.seed, repetition_penalty=s.repetition_penalty,
    )


def generation(sample: cpb.Sample) -> Generation:
    return Generation(
        prompt_token_ids=list(sample.prompt_token_ids),
        completion_token_ids=list(sample.completion_token_ids),
        completion_logprobs=list(sample.completion_logprobs),
        finish_reason=FINISH.get(sample.finish_reason, FinishReason.ERROR),
        version_start=sample.weight_version_start,
        version_end=sample.weight_version_end,
        text=sample.text,
    )


class GrpcRolloutEngine:
    def __init__(
        self, address: str, *, token: str | None = None, timeout: float = 600.0, name: str | None = None,
        max_attempts: int = 2,
    ) -> None:
        self.name = name or address
        self.address = address
        self.timeout = timeout
        # Few transport retries: the engine pool fails over to another replica
        # faster than backing off on a dead one.
        self.channel = open_channel(address, token=token, default_timeout=timeout, max_attempts=max_attempts)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompts: Sequence[PromptInput], sampling: SamplingSpec) -> list[list[Generation]]:
        request = pb.GenerateRequest(
            prompts=[prompt(p) for p in prompts], sampling=sampling_params(sampling),
            run_step=RUN_STEP.get(), min_weight_version=MIN_WEIGHT_VERSION.get(),
        )
        with translated(f"rollout {self.address} Generate"):
            response = await self.stub.Generate(request)
        if len(response.results) != len(prompts):
            raise InvalidArgument(f"rollout {self.address}: {len(response.results)} results for {len(prompts)} prompts")
        return [[generation(s) for s in r.samples] for r in response.results]

    async def tokenize(
        self, *, text: str | None = None, messages: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        if messages is not None:
            request = pb.TokenizeRequest(messages=chat_messages(messages, add_generation_prompt))
        else:
            request = pb.TokenizeRequest(text=text or "", add_special_tokens=False)
        with translated(f"rollout {self.address} Tokenize"):
            return list((await self.stub.Tokenize(request, timeout=30.0)).token_ids)

    async def weight_version(self) -> int:
        with translated(f"rollout {self.address} GetStatus"):
            return (await self.stub.GetStatus(pb.GetStatusRequest(), timeout=30.0)).weight_version

    async def update_weights(self, version: int, source: WeightSource, *, pause_mode: str) -> int:
        request = pb.UpdateWeightsRequest(version=version, method=sync_method(source.method), pause_mode=PAUSE[pause_mode])
        if source.method == "memory":
            request.memory.synchronizer_address = source.synchronizer_address
        elif source.method == "checkpoint":
            request.checkpoint.path = source.path
        else:
            group = source.group
            assert group is not None, "nccl update needs a group"
            request.nccl.CopyFrom(
                pb.NcclSource(
                    group_id=group.group_id, rendezvous_address=group.rendezvous_address,
                    world_size=group.world_size, rank=group.ranks[self.name], backend=group.backend,
                    synchronizer_address=group.synchronizer_address or source.synchronizer_address,
                )
            )
        with translated(f"rollout {self.address} UpdateWeights"):
            return (await self.stub.UpdateWeights(request)).weight_version
