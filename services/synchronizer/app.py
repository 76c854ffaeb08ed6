"""Assembles the synchronizer service for the server bootstrap."""

from __future__ import annotations

import services.synchronizer.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.runtime.server import ServiceSpec
from flywheel.synchronizer.v1 import synchronizer_pb2, synchronizer_pb2_grpc
from services.synchronizer.config import SynchronizerConfig
from services.synchronizer.servicer import SynchronizerServicer

PROTO_SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["SynchronizerService"].full_name


def build(config: SynchronizerConfig) -> ServiceSpec:
    servicer = SynchronizerServicer()
    return ServiceSpec(
        name="synchronizer",
        proto_services=[PROTO_SERVICE],
        register=lambda server: synchronizer_pb2_grpc.add_SynchronizerServiceServicer_to_server(servicer, server),
    )
