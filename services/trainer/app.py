"""Assembles the trainer service for the server bootstrap."""

from __future__ import annotations

from flywheel.runtime.server import ServiceSpec
from flywheel.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.servicer import TrainerServicer

PROTO_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


def build(config: TrainerConfig) -> ServiceSpec:
    servicer = TrainerServicer(config)
    return ServiceSpec(
        name="trainer",
        proto_services=[PROTO_SERVICE],
        register=lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server),
    )
