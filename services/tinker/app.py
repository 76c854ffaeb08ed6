"""Assembles the Tinker gateway for the server bootstrap: the Tinker API over
HTTP (`http_port`, also written to `<ready_file stem>.http.json` for
launchers), and the usual gRPC health service and /metrics. SERVING is
reported once the trainer answered what it holds."""

from __future__ import annotations

import services.tinker.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.rollout.client import RolloutClient
from flywheel.runtime.auth import accepted_tokens, tokens_file_path
from flywheel.runtime.http_server import HttpServer, report_http_port
from flywheel.runtime.server import ServiceSpec
from flywheel.trainer.client import TrainerClient
from services.tinker.config import TinkerConfig
from services.tinker.gateway import Gateway
from services.tinker.http_api import create_app
from services.tinker.tenants import TenantKeys


def build(config: TinkerConfig) -> ServiceSpec:
    state: dict = {}

    async def startup() -> None:
        # The clients' channels belong to the serving event loop: made here, not in build.
        trainer = TrainerClient(config.trainer_address, timeout=config.trainer_timeout_seconds)
        rollout = RolloutClient(config.rollout_address, timeout=config.trainer_timeout_seconds) \
            if config.rollout_address else None
        gateway = state["gateway"] = Gateway(config, trainer, rollout)
        await gateway.start()
        keys = TenantKeys(accepted_tokens(config.server), tokens_file_path(config.server))
        http = state["http"] = HttpServer(create_app(gateway, keys), config.server.host, config.http_port,
                                          name="tinker api")
        report_http_port(config.server.ready_file, await http.start())

    async def shutdown() -> None:
        if "http" in state:
            await state["http"].stop()
        gateway = state.get("gateway")
        if gateway is not None:
            await gateway.close()
            await gateway.trainer.close()
            if gateway.sampler is not None:
                await gateway.sampler.rollout.close()

    return ServiceSpec(name="tinker", proto_services=[], register=lambda server: None, startup=startup,
                       shutdown=shutdown)
