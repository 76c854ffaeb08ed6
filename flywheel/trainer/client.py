"""Typed async client of the trainer service, for the controller and tools.

    async with TrainerClient("127.0.0.1:50052") as trainer:
        batch = make_train_batch(input_ids, loss_mask=mask, advantages=adv, behaviour_logprobs=lp)
        result = await trainer.train_step(batch, make_loss_spec("grpo"), micro_batch_size=4)
        print(result.step, result.metrics["loss"])

Tensors travel as dtype + shape + raw bytes (flywheel.codec), never as lists
of floats. Training calls can take long, so the default deadline here is
generous; pass `timeout=` per call to tighten it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flywheel.codec.dtypes import tensor_from_proto, tensor_to_proto
from flywheel.runtime.client import ChannelClient, open_channel
from flywheel.runtime.server_config import MIB
from flywheel.synchronizer.types import Method
from flywheel.trainer.types import AGGREGATIONS, LOSS_KINDS, AdamStep, LoraShape, aggregation_to_pb, loss_kind_to_pb
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.trainer.v1 import trainer_pb2_grpc as pb_grpc

DEFAULT_TRAIN_TIMEOUT_SECONDS = 600.0


def make_train_batch(
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    weight_versions: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sampling_temperature: torch.Tensor | None = None,
    sampling_top_k: torch.Tensor | None = None,
    sampling_top_p: torch.Tensor | None = None,
    sampler_kept_size: torch.Tensor | None = None,
    sampler_kept_ids: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> pb.TrainBatch:
    """A TrainBatch message from torch tensors ([B, T] unless [B]; sampler_kept_ids [B, T, M], routed_experts
    [B, T, L, K]); None fields stay unset."""
    given = {
        "input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "advantages": advantages,
        "behaviour_logprobs": behaviour_logprobs, "weight_versions": weight_versions, "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs, "sampling_temperature": sampling_temperature, "sampling_top_k": sampling_top_k,
        "sampling_top_p": sampling_top_p, "sampler_kept_size": sampler_kept_size, "sampler_kept_ids": sampler_kept_ids,
        "routed_experts": routed_experts,
    }
    return pb.TrainBatch(**{k: tensor_to_proto(v) for k, v in given.items() if v is not None})


def make_loss_spec(
    kind: str | None = None,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    aggregation: str | None = None,
    is_cap: float = 0.0,
    max_response_length: int = 0,
) -> pb.LossSpec:
    """A LossSpec; None / 0 leave a field to the trainer's configured default."""
    if kind is not None and kind not in LOSS_KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {sorted(LOSS_KINDS)}")
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {sorted(AGGREGATIONS)}")
    return pb.LossSpec(
        kind=loss_kind_to_pb(kind), clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef,
        entropy_coef=entropy_coef, aggregation=aggregation_to_pb(aggregation), is_cap=is_cap,
        max_response_length=max_response_length,
    )


@dataclass
class StepResult:
    step: int
    weight_version: int
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ForwardBackwardResult:
    loss_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    #: The current weights' token log-probs of that forward pass, float32 [B, T], at the loss mask's
    #: positions (0 elsewhere; ComputeLogprobs' layout). None from a trainer that does not send them.
    logprobs: torch.Tensor | None = None


@dataclass
class OptimResult:
    step: int
    weight_version: int
    grad_norm: float
    learning_rate: float


@dataclass
class SavedCheckpoint:
    path: str
    step: int
    size_bytes: int


@dataclass
class LoadedCheckpoint:
    path: str  # empty when latest=True found none
    step: int
    weight_version: int
    client_state: bytes


def _metrics(items) -> dict[str, float]:
    return {m.name: m.value for m in items}


class TrainerClient(ChannelClient):
    def __init__(
        self, address: str, *, token: str | None = None, timeout: float = DEFAULT_TRAIN_TIMEOUT_SECONDS,
        max_message_bytes: int = 64 * MIB,
    ) -> None:
        self.channel = open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes)
        self.stub = pb_grpc.TrainerServiceStub(self.channel)

    async def get_info(self, *, timeout: float | None = 10.0) -> pb.GetInfoResponse:
        return await self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout)

    async def forward_backward(
        self, batch: pb.TrainBatch, loss: pb.LossSpec | None = None, *, expected_step: int | None = None,
        forward_only: bool = False, timeout: float | None = None,
    ) -> ForwardBackwardResult:
        """`forward_only`: the loss, metrics and log-probs without keeping gradients (Tinker's forward)."""
        request = pb.ForwardBackwardRequest(batch=batch, loss=loss or pb.LossSpec(), expected_step=expected_step,
                                            forward_only=forward_only)
        response = await self.stub.ForwardBackward(request, timeout=timeout)
        logprobs = tensor_from_proto(response.logprobs) if response.HasField("logprobs") else None
        return ForwardBackwardResult(response.loss_tokens, _metrics(response.metrics), logprobs)

    async def optim_step(self, *, expected_step: int | None = None, adam: AdamStep | None = None,
                         timeout: float | None = None) -> OptimResult:
        """`adam`: this step's Adam parameters (the trainer's configured ones and schedule otherwise)."""
        request = pb.OptimStepRequest(expected_step=expected_step, adam=adam.to_pb() if adam is not None else None)
        response = await self.stub.OptimStep(request, timeout=timeout)
        return OptimResult(response.step, response.weight_version, response.grad_norm, response.learning_rate)

    async def train_step(
        self, batch: pb.TrainBatch, loss: pb.LossSpec | None = None, *, micro_batch_size: int = 0,
        expected_step: int | None = None, timeout: float | None = None,
    ) -> StepResult:
        request = pb.TrainStepRequest(
            batch=batch, loss=loss or pb.LossSpec(), micro_batch_size=micro_batch_size, expected_step=expected_step
        )
        response = await self.stub.TrainStep(request, timeout=timeout)
        return StepResult(response.step, response.weight_version, response.tokens, _metrics(response.metrics))

    async def compute_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, reference: bool = False,
        micro_batch_size: int = 0, timeout: float | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(log-probs float32 [B, T] with position 0 = 0, weight version that computed them)."""
        request = pb.ComputeLogprobsRequest(
            batch=make_train_batch(input_ids, attention_mask=attention_mask),
            model=pb.LOGPROB_MODEL_REFERENCE if reference else pb.LOGPROB_MODEL_POLICY,
            micro_batch_size=micro_batch_size,
        )
        response = await self.stub.ComputeLogprobs(request, timeout=timeout)
        return tensor_from_proto(response.logprobs), response.weight_version

    async def save_checkpoint(
        self, directory: str = "", *, remove_previous: bool = False, client_state: bytes = b"",
        timeout: float | None = None,
    ) -> SavedCheckpoint:
        request = pb.SaveCheckpointRequest(directory=directory, remove_previous=remove_previous, client_state=client_state)
        response = await self.stub.SaveCheckpoint(request, timeout=timeout)
        return SavedCheckpoint(response.path, response.step, response.size_bytes)

    async def load_checkpoint(
        self, path: str = "", *, latest: bool = False, timeout: float | None = None
    ) -> LoadedCheckpoint:
        response = await self.stub.LoadCheckpoint(pb.LoadCheckpointRequest(path=path, latest=latest), timeout=timeout)
        return LoadedCheckpoint(response.path, response.step, response.weight_version, response.client_state)

    async def select_model(self, model_id: str, *, shape: LoraShape = LoraShape(),
                           timeout: float | None = None) -> bool:
        """Makes `model_id` the trainer's live model (LoRA: several on one base); True when it was created
        (with `shape`: its own rank and modules)."""
        response = await self.stub.SelectModel(pb.SelectModelRequest(
            model_id=model_id, lora_rank=shape.rank, lora_modules=list(shape.modules)), timeout=timeout)
        return response.created

    async def drop_model(self, model_id: str, *, timeout: float | None = None) -> None:
        await self.stub.DropModel(pb.DropModelRequest(model_id=model_id), timeout=timeout)

    async def export_weights(
        self, method: str, *, directory: str = "", group_id: str = "",
        merge_lora: bool = True, timeout: float | None = None,
    ) -> pb.ExportWeightsResponse:
        """Exports the current version (the operator's path; a linked trainer publishes by itself):
        memory to the trainer's own synchronizer, checkpoint into `directory` (empty: its publish_dir),
        nccl over `group_id`. Merged LoRA by default: rollouts serve full models."""
        request = pb.ExportWeightsRequest(method=int(Method[method.upper()]), merge_lora=merge_lora)
        if method == "memory":
            request.memory.SetInParent()
        elif method == "checkpoint":
            request.checkpoint.directory = directory
        else:
            request.nccl.group_id = group_id
        return await self.stub.ExportWeights(request, timeout=timeout)
