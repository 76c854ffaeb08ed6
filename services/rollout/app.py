"""Assembles the rollout service for the server bootstrap."""

from __future__ import annotations

from flywheel.rollout.v1 import rollout_pb2, rollout_pb2_grpc
import services.rollout.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.runtime.server import ServiceSpec
from services.rollout.config import RolloutConfig
from services.rollout.servicer import RolloutServicer

PROTO_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


def build(config: RolloutConfig) -> ServiceSpec:
    servicer = RolloutServicer(config)
    return ServiceSpec(
        name="rollout",
        proto_services=[PROTO_SERVICE],
        register=lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server),
    )
