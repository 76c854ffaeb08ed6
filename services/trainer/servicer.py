"""gRPC servicer of the trainer: translates protobuf to the domain and back.

Blocking work (tensor decoding, training, checkpoints) runs in a worker thread
so the event loop keeps answering health checks and GetInfo during a step.
ExportWeights is checked here (method and target must agree) and carried
out by `services.trainer.export.WeightExporter`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from torch import Tensor

from flywheel.codec.dtypes import tensor_from_proto, tensor_to_proto
from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.runtime.auth import own_token
from flywheel.synchronizer.types import Method, method_name
from flywheel.trainer.types import AdamStep, LoraShape, aggregation_from_pb, loss_kind_from_pb
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.trainer.v1 import trainer_pb2_grpc as pb_grpc
from services.trainer import metrics as prom
from services.trainer.export import ExportResult, WeightExporter
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine

DTYPES = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
}
#: SyncMethod -> the ExportWeightsRequest oneof field that targets it (named like the method).
EXPORT_TARGETS = {int(m): method_name(m) for m in Method}
BATCH_FIELDS = tuple(f.name for f in pb.TrainBatch.DESCRIPTOR.fields)


def batch_tensors(msg: pb.TrainBatch) -> dict[str, Tensor | None]:
    """Decodes every tensor the batch carries; absent fields are None."""
    out: dict[str, Tensor | None] = {}
    for name in BATCH_FIELDS:
        if not msg.HasField(name):
            out[name] = None
            continue
        try:
            out[name] = tensor_from_proto(getattr(msg, name))
        except InvalidArgument as exc:
            raise InvalidArgument(f"batch.{name}: {exc}") from None
    return out


def loss_request(msg: pb.LossSpec) -> LossRequest:
    def enum(value: int, name_of, field: str) -> str | None:
        try:
            return name_of(value)
        except ValueError:
            raise InvalidArgument(f"loss.{field}: unknown enum value {value}") from None

    return LossRequest(
        kind=enum(msg.kind, loss_kind_from_pb, "kind"),
        clip_low=msg.clip_low,
        clip_high=msg.clip_high,
        kl_coef=msg.kl_coef,
        entropy_coef=msg.entropy_coef,
        aggregation=enum(msg.aggregation, aggregation_from_pb, "aggregation"),
        is_cap=msg.is_cap,
        max_response_length=msg.max_response_length,
    )


def _metrics(values: dict[str, float]) -> list[common_pb2.Metric]:
    return [common_pb2.Metric(name=k, value=v) for k, v in sorted(values.items())]


def _expected(msg) -> int | None:
    return msg.expected_step if msg.HasField("expected_step") else None


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    def __init__(self, engine: TrainingEngine, exporter: WeightExporter | None = None) -> None:
        self.engine = engine
        server = engine.config.server
        token = own_token(server)
        self.exporter = exporter or WeightExporter(engine, engine.config.sync, token)
        #: Runs after every optimizer step, before the step's RPC answers (the publisher, when linked).
        self.after_step: Callable[[], Awaitable[None]] | None = None

    async def _stepped(self) -> None:
        if self.after_step is not None:
            await self.after_step()

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        info = self.engine.info()
        return pb.GetInfoResponse(
            model_name=info.model_name,
            parameter_count=info.parameter_count,
            trainable_parameter_count=info.trainable_count,
            dtype=DTYPES[info.dtype],
            device=info.device,
            step=info.step,
            weight_version=info.weight_version,
            ready=info.ready,
            lora_rank=info.lora_rank,
            lora_target_modules=info.lora_target_modules,
            model_ids=info.model_ids,
        )

    async def ForwardBackward(self, request: pb.ForwardBackwardRequest, context) -> pb.ForwardBackwardResponse:
        loss = loss_request(request.loss)
        started = time.perf_counter()
        result = await self.engine.run(
            lambda: self.engine.forward_backward(batch_tensors(request.batch), loss, _expected(request),
                                                 request.forward_only)
        )
        prom.COMPUTE_SECONDS.labels("forward_backward").inc(time.perf_counter() - started)
        prom.TOKENS.inc(result.tokens)
        return pb.ForwardBackwardResponse(metrics=_metrics(result.metrics), loss_tokens=result.loss_tokens,
                                          logprobs=tensor_to_proto(result.logprobs))

    async def OptimStep(self, request: pb.OptimStepRequest, context) -> pb.OptimStepResponse:
        adam = AdamStep.from_pb(request.adam) if request.HasField("adam") else None
        started = time.perf_counter()
        result = await self.engine.run(self.engine.optim_step, _expected(request), adam)
        prom.COMPUTE_SECONDS.labels("optim_step").inc(time.perf_counter() - started)
        prom.STEP.set(result.step)
        await self._stepped()
        return pb.OptimStepResponse(
            step=result.step, weight_version=result.weight_version,
            grad_norm=result.grad_norm, learning_rate=result.learning_rate,
        )

    async def TrainStep(self, request: pb.TrainStepRequest, context) -> pb.TrainStepResponse:
        loss = loss_request(request.loss)
        started = time.perf_counter()
        result = await self.engine.run(
            lambda: self.engine.train_step(
                batch_tensors(request.batch), loss, request.micro_batch_size, _expected(request)
            )
        )
        prom.STEP_DURATION.observe(time.perf_counter() - started)
        prom.STEP.set(result.step)
        prom.TOKENS.inc(result.tokens)
        await self._stepped()
        return pb.TrainStepResponse(
            metrics=_metrics(result.metrics), step=result.step, weight_version=result.weight_version,
            tokens=result.tokens,
        )

    async def ComputeLogprobs(self, request: pb.ComputeLogprobsRequest, context) -> pb.ComputeLogprobsResponse:
        if request.model not in (pb.LOGPROB_MODEL_UNSPECIFIED, pb.LOGPROB_MODEL_POLICY, pb.LOGPROB_MODEL_REFERENCE):
            raise InvalidArgument(f"model: unknown enum value {request.model}")
        reference = request.model == pb.LOGPROB_MODEL_REFERENCE

        def run():
            logprobs, version = self.engine.compute_logprobs(
                batch_tensors(request.batch), reference, request.micro_batch_size
            )
            return tensor_to_proto(logprobs), version

        tensor, version = await self.engine.run(run)
        return pb.ComputeLogprobsResponse(logprobs=tensor, weight_version=version)

    async def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context) -> pb.SaveCheckpointResponse:
        directory = Path(request.directory) if request.directory else None
        path, step, size = await self.engine.run(
            self.engine.save_checkpoint, directory, request.remove_previous, request.client_state
        )
        return pb.SaveCheckpointResponse(path=str(path), step=step, size_bytes=size)

    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest, context) -> pb.LoadCheckpointResponse:
        path = Path(request.path) if request.path else None
        loaded, step, version, client_state = await self.engine.run(
            self.engine.load_checkpoint, path, request.latest
        )
        prom.STEP.set(step)
        return pb.LoadCheckpointResponse(
            path=str(loaded or ""), step=step, weight_version=version, client_state=client_state
        )

    async def SelectModel(self, request: pb.SelectModelRequest, context) -> pb.SelectModelResponse:
        if self.after_step is not None and request.model_id != "":
            # A linked trainer publishes every step to the synchronizer's one version line.
            raise FailedPrecondition("this trainer publishes its weights to a synchronizer (sync."
                                     "synchronizer_address): it trains one model; several need a standalone trainer")
        policy = self.engine.policy
        if policy is not None and policy.model_id == request.model_id:
            # Selected already (the Tinker gateway selects before each request): answered here rather than
            # on the compute thread, behind a step. Only SelectModel changes the selection, and its caller
            # (one gateway) waits for each before it sends the next.
            return pb.SelectModelResponse(created=False, step=policy.step)
        shape = LoraShape(request.lora_rank, tuple(request.lora_modules))
        started = time.perf_counter()
        created, step = await self.engine.run(self.engine.select_model, request.model_id, shape)
        prom.COMPUTE_SECONDS.labels("select_model").inc(time.perf_counter() - started)
        prom.STEP.set(step)
        return pb.SelectModelResponse(created=created, step=step)

    async def DropModel(self, request: pb.DropModelRequest, context) -> pb.DropModelResponse:
        await self.engine.run(self.engine.drop_model, request.model_id)
        return pb.DropModelResponse()

    async def ExportWeights(self, request: pb.ExportWeightsRequest, context) -> pb.ExportWeightsResponse:
        result = await export_weights(self.exporter, request)
        prom.WEIGHT_VERSION.set(result.weight_version)
        return pb.ExportWeightsResponse(
            weight_version=result.weight_version, bytes=result.bytes,
            duration_seconds=result.duration_seconds, path=result.path, identity=result.identity,
        )


async def export_weights(exporter: WeightExporter, request: pb.ExportWeightsRequest) -> ExportResult:
    """Checks that method and target agree, then runs the export."""
    method = request.method
    if method not in EXPORT_TARGETS:
        known = ", ".join(common_pb2.SyncMethod.Name(m) for m in EXPORT_TARGETS)
        raise InvalidArgument(f"method: must be one of {known}, got {method}")
    want = EXPORT_TARGETS[method]
    target = request.WhichOneof("target")
    if target is not None and target != want:
        raise InvalidArgument(
            f"{target}: the target does not match method {common_pb2.SyncMethod.Name(method)} (set {want} instead)"
        )
    if want == "memory":
        m = request.memory
        return await exporter.memory(chunk_bytes=m.chunk_bytes, bucket_bytes=m.bucket_bytes, merge_lora=request.merge_lora)
    if want == "checkpoint":
        return await exporter.checkpoint(request.checkpoint.directory, merge_lora=request.merge_lora)
    return await exporter.nccl(request.nccl.group_id, merge_lora=request.merge_lora)
