"""Assembles the controller service for the server bootstrap."""

from __future__ import annotations

from flywheel.controller.v1 import controller_pb2, controller_pb2_grpc
import services.controller.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.runtime.server import ServiceSpec
from services.controller.config import ControllerConfig
from services.controller.servicer import ControllerServicer

PROTO_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name


def build(config: ControllerConfig) -> ServiceSpec:
    servicer = ControllerServicer()
    return ServiceSpec(
        name="controller",
        proto_services=[PROTO_SERVICE],
        register=lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server),
    )
