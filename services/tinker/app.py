"""Assembles the Tinker gateway for the server bootstrap: the Tinker API over
HTTP (`http_port`), and the usual gRPC health service and /metrics. SERVING is
reported once the trainer answered what it holds."""

from __future__ import annotations

from flywheel.rollout.client import RolloutClient
from flywheel.runtime.auth import accepted_tokens
from flywheel.runtime.http_server import HttpServer
from flywheel.runtime.server import ServiceSpec
from flywheel.trainer.client import TrainerClient
from services.tinker.config import TinkerConfig
from services.tinker.gateway import Gateway
from services.tinker.http_api import create_app


def build(config: TinkerConfig) -> ServiceSpec:
    trainer = TrainerClient(config.trainer_address, timeout=config.trainer_timeout_seconds)
    rollout = RolloutClient(config.rollout_address, timeout=config.trainer_timeout_seconds) \
        if config.rollout_address else None
    gateway = Gateway(config, trainer, rollout)
    http = HttpServer(create_app(gateway, accepted_tokens(config.server)), config.server.host, config.http_port,
                      name="tinker api")

    async def startup() -> None:
        await gateway.start()
        await http.start()

    async def shutdown() -> None:
        await http.stop()
        await gateway.close()
        await trainer.close()
        if rollout is not None:
            await rollout.close()

    return ServiceSpec(name="tinker", proto_services=[], register=lambda server: None, startup=startup,
                       shutdown=shutdown)
