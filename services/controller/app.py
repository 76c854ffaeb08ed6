"""Assembles the controller service for the server bootstrap.

One process, two ways in: `python -m services.controller` waits for Start
calls, and `python -m services.controller run FILE` (launcher/launch.py) drives one
run itself. Both serve the same gRPC API, health, /metrics and status page
(ops/status_page.py) from `service_spec`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import services.controller.telemetry.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.controller.v1 import controller_pb2, controller_pb2_grpc
from flywheel.runtime.auth import Scope, accepted_tokens
from flywheel.runtime.http_server import HttpServer
from flywheel.runtime.server import ServiceSpec
from services.controller.adapters import connect
from services.controller.config import ControllerConfig
from services.controller.telemetry.metrics_log import PrometheusSink
from services.controller.ops.runs import RunManager
from services.controller.servicer import ControllerServicer
from services.controller.ops.status_page import create_app

PROTO_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name

log = logging.getLogger(__name__)


def service_spec(
    config: ControllerConfig, runs: RunManager, on_status_page: Callable[[int], None] | None = None,
    free_status_port_if_taken: bool = False,
) -> ServiceSpec:
    """The controller's servicer, plus its status page started before SERVING
    (`on_status_page` is told the bound port) and stopped at shutdown. `free_status_port_if_taken`:
    a status page port another process holds gives way to a free one (the local launcher's runs)."""
    servicer = ControllerServicer(runs)
    page = HttpServer(create_app(runs, accepted_tokens(config.server)), config.server.host, config.status_port,
                      name="status page", free_port_if_taken=free_status_port_if_taken)

    async def startup() -> None:
        port = await page.start()
        if on_status_page is not None:
            on_status_page(port)

    async def shutdown() -> None:
        await page.stop()
        await runs.close()

    return ServiceSpec(
        name="controller",
        proto_services=[PROTO_SERVICE],
        register=lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server),
        # What the status page shows, over gRPC, for the same read-only token; runs start and stop by operators.
        method_scopes={"Status": Scope.VIEWER, "StreamMetrics": Scope.VIEWER},
        startup=startup,
        shutdown=shutdown,
    )


def build(config: ControllerConfig) -> ServiceSpec:
    runs = RunManager(config.runs_dir, connect, sinks=lambda: [PrometheusSink()])
    return service_spec(config, runs)
