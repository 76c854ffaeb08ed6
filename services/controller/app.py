"""Assembles the controller service for the server bootstrap."""

from __future__ import annotations

import services.controller.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.controller.v1 import controller_pb2, controller_pb2_grpc
from flywheel.runtime.server import ServiceSpec
from services.controller.adapters import connect
from services.controller.config import ControllerConfig
from services.controller.metrics_log import PrometheusSink
from services.controller.runs import RunManager
from services.controller.servicer import ControllerServicer

PROTO_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name


def build(config: ControllerConfig) -> ServiceSpec:
    runs = RunManager(config.runs_dir, connect, sinks=lambda: [PrometheusSink()])
    servicer = ControllerServicer(runs)
    return ServiceSpec(
        name="controller",
        proto_services=[PROTO_SERVICE],
        register=lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server),
        shutdown=runs.close,
    )
