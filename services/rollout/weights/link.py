"""The rollout's link to the synchronizer (`synchronizer.address` set): its
presence there (registration, heartbeats, update reports) and the follower
that moves its weights as the synchronizer's policy directs
(`services.rollout.weights.follower`), which also gates every generation.

Started once the engine is loaded, stopped on graceful shutdown (which
deregisters). Without an address the rollout is standalone and none of this
runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flywheel.runtime.auth import own_token
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.presence import advertised_address, reachable_host
from flywheel.transfer.cuda_ipc import gpu_label
from services.rollout.config import RolloutConfig
from services.rollout.weights.arrival import WeightArrival
from services.rollout.weights.follower import Follower
from services.rollout.weights.peers import PEER_LABEL
from services.rollout.weights.presence import RolloutPresence


def device_of(engine_kind: str, engine_args: Mapping[str, Any]) -> str:
    """The device the engine computes on, as the synchronizer's `auto` group backend reads it
    ("cuda" on every member picks nccl, one GPU for all ipc): vLLM uses the GPU whenever torch
    sees one (the current device: its worker's with one worker); the transformers engine, the
    device of its `device` argument (default cpu)."""
    import torch

    if engine_kind != "vllm":
        device = torch.device(str(engine_args.get("device", "cpu")))
        return str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def default_component_id(config: RolloutConfig, grpc_port: int) -> str:
    return f"rollout-{reachable_host(config.server.host)}-{grpc_port}"


class SynchronizerLink:
    def __init__(self, config: RolloutConfig, arrival: WeightArrival, grpc_port: int) -> None:
        link, server = config.synchronizer, config.server
        self.component_id = link.component_id or default_component_id(config, grpc_port)
        self.client = SynchronizerClient(
            link.address, own_token(server), timeout=link.rpc_timeout_seconds, max_message_bytes=server.max_message_bytes
        )
        # Every update, whoever asks for it, is checked against what this synchronizer recorded.
        arrival.attach(self.client, self.component_id)
        core = arrival.updates.core
        status = core.status()
        device = device_of(status.engine, config.engine.args)
        self.follower = Follower(self.client, arrival, config, self.component_id)
        self.presence = RolloutPresence(
            self.client, arrival.updates, link, self.component_id, advertised_address(link, server.host, grpc_port),
            labels={"model": core.model_name, "engine": status.engine, "device": device, **gpu_label(device),
                    **({"site": link.site} if link.site else {}),
                    **({PEER_LABEL: "1"} if config.updates.serve_peers else {})},
            step=lambda: self.follower.step,
        )
        self.core, self.arrival = core, arrival

    def start(self) -> None:
        self.presence.start()
        self.follower.start()
        self.core.weights_gate = self.follower.before_generate

    async def ready(self, timeout: float) -> None:
        """Registered, and on the newest committed version (each within `timeout`), before SERVING."""
        if await self.presence.wait_registered(timeout):
            await self.follower.catch_up(self.core.config.updates.timeout_seconds)

    async def stop(self) -> None:
        # The follower first: an update it starts now would be reported to nobody.
        self.core.weights_gate = None
        await self.follower.stop()
        await self.presence.stop()
        self.arrival.detach()
        await self.client.close()
