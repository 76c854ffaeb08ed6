"""Settings of a component's presence at the synchronizer (registration,
heartbeats, retries), shared by the trainer's and the rollout's configs.

Imports nothing heavy: the services' `--help` stays instant.
"""

from __future__ import annotations

from pydantic import Field

from flywheel.runtime.config import StrictModel


class PresenceConfig(StrictModel):
    advertise_address: str = Field(
        "", description='"host:port" where the controller and the synchronizer reach this service\'s gRPC server; '
        "empty: server.host (the machine's hostname when it is a wildcard) and the bound gRPC port"
    )
    heartbeat_interval_seconds: float = Field(
        0.0, ge=0, description="seconds between heartbeats; 0: a third of the lease the synchronizer grants"
    )
    rpc_timeout_seconds: float = Field(
        10.0, gt=0, description="deadline of each Register/Heartbeat/SetState/Deregister call, in seconds"
    )
    retry_initial_seconds: float = Field(
        0.5, gt=0, description="first wait before retrying an unreachable synchronizer, doubled per failure, in seconds"
    )
    retry_max_seconds: float = Field(30.0, gt=0, description="longest wait between retries, in seconds")
