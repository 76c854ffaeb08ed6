"""Assembles the trainer service for the server bootstrap.

The model loads in `startup`, in a worker thread: the event loop keeps
answering health checks (NOT_SERVING) meanwhile, and SERVING is reported only
once the policy is ready.
"""

from __future__ import annotations

import asyncio
import gc

import services.trainer.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.runtime.server import ServiceSpec
from flywheel.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.servicer import TrainerServicer
from services.trainer.training import TrainingEngine

PROTO_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


def build(config: TrainerConfig) -> ServiceSpec:
    engine = TrainingEngine(config)
    servicer = TrainerServicer(engine)

    async def startup() -> None:
        if config.model.path is not None:
            await asyncio.to_thread(engine.load)
            # What exists now (torch, transformers, the model: ~10^5 objects)
            # lives as long as the process; frozen, the cyclic collector stops
            # rescanning it during every training step.
            gc.collect()
            gc.freeze()

    async def shutdown() -> None:
        # Frozen objects are never collected; extension modules (nanobind)
        # then report them as leaked at exit.
        gc.unfreeze()

    return ServiceSpec(
        name="trainer",
        proto_services=[PROTO_SERVICE],
        register=lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server),
        startup=startup,
        shutdown=shutdown,
    )
