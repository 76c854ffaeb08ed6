"""Asking a service for its gRPC health (the standard grpc.health.v1 protocol)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel.runtime.client import open_channel


async def check_health(address: str, service: str = "", timeout: float = 5.0) -> str:
    """SERVING, NOT_SERVING, SERVICE_UNKNOWN... or UNAVAILABLE if nothing answers."""
    async with open_channel(address, default_timeout=timeout, max_attempts=1) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
