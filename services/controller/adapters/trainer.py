"""The trainer service behind the controller's `Trainer` protocol: a thin user
of the typed client (`flywheel.trainer.client`). TrainBatch tensors go out as
dtype + shape + raw bytes (flywheel.codec), the loss config as a LossSpec;
results come back as domain types, failures as domain errors.
"""

from __future__ import annotations

from flywheel.codec.dtypes import tensor_to_proto
from flywheel.errors import Unavailable
from flywheel.runtime.client import translated
from flywheel.runtime.server_config import MIB
from flywheel.trainer.client import TrainerClient, make_loss_spec
from flywheel.trainer.v1 import trainer_pb2 as pb
from services.controller.batches.batching import TrainBatch
from services.controller.domain import RestoredCheckpoint, TrainerState, TrainResult
from services.controller.run_config import LossConfig


def loss_spec(loss: LossConfig, max_response_length: int = 0) -> pb.LossSpec:
    """`max_response_length`: the run's maximum completion length, in tokens (Dr. GRPO's constant)."""
    return make_loss_spec(
        loss.kind, clip_low=loss.clip_low, clip_high=loss.clip_high or 0.0, kl_coef=loss.kl_coef,
        entropy_coef=loss.entropy_coef, aggregation=loss.aggregation, is_cap=loss.is_cap,
        max_response_length=max_response_length,
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
        self.client = TrainerClient(address, token=token, timeout=timeout, max_message_bytes=max_message_bytes)
        self.remove_previous = remove_previous_checkpoints
        self.max_response_length = max_response_length

    async def close(self) -> None:
        await self.client.close()

    async def get_state(self) -> TrainerState:
        with translated(f"trainer {self.address} GetInfo"):
            info = await self.client.get_info(timeout=30.0)
        if not info.ready:
            raise Unavailable(f"trainer {self.address} has no model loaded yet")
        return TrainerState(info.step, info.weight_version)

    async def train_step(
        self, batch: TrainBatch, loss: LossConfig, *, micro_batch_size: int, expected_step: int | None
    ) -> TrainResult:
        with translated(f"trainer {self.address} TrainStep"):
            r = await self.client.train_step(train_batch(batch), loss_spec(loss, self.max_response_length),
                                             micro_batch_size=micro_batch_size, expected_step=expected_step)
        return TrainResult(r.step, r.weight_version, r.tokens, r.metrics)

    async def save_checkpoint(self, client_state: bytes) -> str:
        with translated(f"trainer {self.address} SaveCheckpoint"):
            return (await self.client.save_checkpoint(remove_previous=self.remove_previous,
                                                      client_state=client_state)).path

    async def load_checkpoint(self, path: str | None) -> RestoredCheckpoint | None:
        with translated(f"trainer {self.address} LoadCheckpoint"):
            r = await self.client.load_checkpoint(path or "", latest=path is None)
        if not r.path:
            return None
        return RestoredCheckpoint(r.path, r.step, r.weight_version, r.client_state)
