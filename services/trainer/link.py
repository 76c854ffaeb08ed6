"""The trainer's presence at the synchronizer (`sync.synchronizer_address` set).

Once the policy is loaded (a resumed checkpoint included), the trainer
registers as `sync.trainer_id` with role trainer, the address of its gRPC
server and every export method it serves, then heartbeats its step and weight
version (`flywheel.synchronizer.presence`), and publishes the versions the
synchronizer's policy makes due (`services.trainer.publisher`). Stopped on
graceful shutdown, which deregisters it.
"""

from __future__ import annotations

from flywheel.runtime.auth import own_token
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.presence import Presence, advertised_address
from flywheel.synchronizer.types import Method, Role
from flywheel.transfer.cuda_ipc import gpu_label
from services.trainer.config import TrainerConfig
from services.trainer.export import WeightExporter
from services.trainer.publisher import Publisher
from services.trainer.training import TrainingEngine

#: WeightExporter's methods; NCCL works because an address is configured here.
CAPABILITIES = (Method.MEMORY, Method.CHECKPOINT, Method.NCCL)


class TrainerLink:
    def __init__(self, config: TrainerConfig, engine: TrainingEngine, grpc_port: int) -> None:
        sync, server = config.sync, config.server
        token = own_token(server)
        self.client = SynchronizerClient(
            sync.synchronizer_address or "", token, timeout=sync.rpc_timeout_seconds,
            max_message_bytes=server.max_message_bytes,
        )

        def progress() -> tuple[int, int]:
            # info() reads the policy without its lock: a beat never waits for a training step.
            info = engine.info()
            return info.step, info.weight_version

        self.presence = Presence(
            self.client, Role.TRAINER, sync.trainer_id, advertised_address(sync, server.host, grpc_port), sync,
            progress, capabilities=CAPABILITIES,
            labels={"model": engine.info().model_name, "device": config.model.device,
                    **gpu_label(config.model.device)},
        )

        self.config = config
        self.publisher = Publisher(self.client, WeightExporter(engine, sync, token), engine, config)

    def start(self) -> None:
        self.presence.start()
        if self.config.sync.publish:
            self.publisher.start()

    async def stop(self) -> None:
        await self.publisher.stop()
        await self.presence.stop()
        await self.client.close()
