"""The rollout's link to the synchronizer (`synchronizer.address` set): its
presence there (registration, heartbeats, update reports) and, with
`synchronizer.follow`, the follower that applies committed versions.

Started once the engine is loaded, stopped on graceful shutdown (which
deregisters). Without an address the rollout is standalone and none of this
runs.
"""

from __future__ import annotations

from flywheel.runtime.auth import resolve_token
from services.rollout.config import RolloutConfig
from services.rollout.core import RolloutCore
from services.rollout.follower import Follower
from services.rollout.presence import RolloutPresence
from services.synchronizer.client import SynchronizerClient
from services.synchronizer.presence import advertised_address, reachable_host


def default_component_id(config: RolloutConfig, grpc_port: int) -> str:
    return f"rollout-{reachable_host(config.server.host)}-{grpc_port}"


class SynchronizerLink:
    def __init__(self, config: RolloutConfig, core: RolloutCore, grpc_port: int) -> None:
        link, server = config.synchronizer, config.server
        token = resolve_token(server.auth_token.get_secret_value() if server.auth_token else None, server.auth_token_file)
        self.component_id = link.component_id or default_component_id(config, grpc_port)
        self.client = SynchronizerClient(
            link.address, token, timeout=link.rpc_timeout_seconds, max_message_bytes=server.max_message_bytes
        )
        status = core.status()
        self.presence = RolloutPresence(
            self.client, core, link, self.component_id, advertised_address(link, server.host, grpc_port),
            labels={"model": core.model_name, "engine": status.engine},
        )
        self.follower = Follower(self.client, core, config, self.component_id, token=token) if link.follow else None

    def start(self) -> None:
        self.presence.start()
        if self.follower is not None:
            self.follower.start()

    async def stop(self) -> None:
        # The follower first: an update it starts now would be reported to nobody.
        if self.follower is not None:
            await self.follower.stop()
        await self.presence.stop()
        await self.client.close()
