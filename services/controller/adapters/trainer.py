"""The trainer service behind the controller's `Trainer` protocol.

Thin translation only: TrainBatch tensors go out as dtype + shape + raw bytes
(flywheel.codec), the loss config as a LossSpec, results come back as domain
types; RPC failures become domain errors (adapters/errors.py).
"""

from __future__ import annotations

from flywheel.codec.dtypes import tensor_to_proto
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import Unavailable
from flywheel.runtime.client import open_channel
from flywheel.runtime.server_config import MIB
from flywheel.synchronizer.types import Method
from flywheel.trainer.types import aggregation_to_pb, loss_kind_to_pb
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.trainer.v1 import trainer_pb2_grpc as pb_grpc
from flywheel.runtime.client import translated
from services.controller.batching import TrainBatch
from services.controller.domain import RestoredCheckpoint, TrainerState, TrainResult, WeightSource
from services.controller.run_config import LossConfig



def sync_method(name: str) -> int:
    """A sync method's proto number (the enum's values are the proto's)."""
    return int(Method[name.upper()])


def loss_spec(loss: LossConfig, max_response_length: int = 0) -> pb.LossSpec:
    """`max_response_length`: the run's maximum completion length, in tokens (Dr. GRPO's constant)."""
    return pb.LossSpec(
        kind=loss_kind_to_pb(loss.kind),
        clip_low=loss.clip_low,
        clip_high=loss.clip_high or 0.0,
        kl_coef=loss.kl_coef,
        entropy_coef=loss.entropy_coef,
        aggregation=aggregation_to_pb(loss.aggregation),
        max_response_length=max_response_length,
        is_cap=loss.is_cap,
    )


def train_batch(batch: TrainBatch) -> pb.TrainBatch:
    return pb.TrainBatch(**{name: tensor_to_proto(t) for name, t in batch.tensors.items()})


class GrpcTrainer:
    def __init__(
        self, address: str, *, token: str | None = None, timeout: float = 600.0, max_message_bytes: int = 256 * MIB,
        remove_previous_checkpoints: bool = False, max_response_length: int = 0,
    ) -> None:
        """`max_response_length`: the run's maximum completion length (worker.sampling.max_tokens)."""
        self.address = address
        self.channel = open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes)
        self.stub = pb_grpc.TrainerServiceStub(self.channel)
        self.remove_previous = remove_previous_checkpoints
        self.max_response_length = max_response_length

    async def close(self) -> None:
        await self.channel.close()

    async def get_state(self) -> TrainerState:
        with translated(f"trainer {self.address} GetInfo"):
            info = await self.stub.GetInfo(pb.GetInfoRequest(), timeout=30.0)
        if not info.ready:
            raise Unavailable(f"trainer {self.address} has no model loaded yet")
        return TrainerState(info.step, info.weight_version)

    async def train_step(
        self, batch: TrainBatch, loss: LossConfig, *, micro_batch_size: int, expected_step: int | None
    ) -> TrainResult:
        request = pb.TrainStepRequest(
            batch=train_batch(batch), loss=loss_spec(loss, self.max_response_length), micro_batch_size=micro_batch_size, expected_step=expected_step
        )
        with translated(f"trainer {self.address} TrainStep"):
            response = await self.stub.TrainStep(request)
        metrics = {m.name: m.value for m in response.metrics}
        return TrainResult(response.step, response.weight_version, response.tokens, metrics)

    async def save_checkpoint(self, client_state: bytes) -> str:
        request = pb.SaveCheckpointRequest(remove_previous=self.remove_previous, client_state=client_state)
        with translated(f"trainer {self.address} SaveCheckpoint"):
            return (await self.stub.SaveCheckpoint(request)).path

    async def load_checkpoint(self, path: str | None) -> RestoredCheckpoint | None:
        request = pb.LoadCheckpointRequest(path=path or "", latest=path is None)
        with translated(f"trainer {self.address} LoadCheckpoint"):
            response = await self.stub.LoadCheckpoint(request)
        if not response.path:
            return None
        return RestoredCheckpoint(response.path, response.step, response.weight_version, response.client_state)

    async def export_weights(self, source: WeightSource) -> WeightSource:
        # Merged: rollouts serve full models, so a LoRA policy sends its adapters folded in.
        request = pb.ExportWeightsRequest(method=sync_method(source.method), merge_lora=True)
        if source.method == "memory":
            request.memory.synchronizer_address = source.synchronizer_address
        elif source.method == "checkpoint":
            request.checkpoint.directory = source.path
        else:
            assert source.group is not None, "nccl export needs a group"
            request.nccl.group_id = source.group.group_id
        with translated(f"trainer {self.address} ExportWeights"):
            response = await self.stub.ExportWeights(request)
        if source.method == "checkpoint":
            return WeightSource("checkpoint", path=response.path)
        return source
