"""Liveness of a remote service by the standard grpc.health.v1 Check."""

from __future__ import annotations

from flywheel.runtime.health import check_health


class GrpcHealthProbe:
    def __init__(self, name: str, address: str, service: str = "", timeout: float = 5.0) -> None:
        self.name, self.address, self.service, self.timeout = name, address, service, timeout

    async def check(self) -> bool:
        return await check_health(self.address, self.service, self.timeout) == "SERVING"
