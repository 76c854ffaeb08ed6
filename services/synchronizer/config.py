"""Configuration of the synchronizer service."""

from __future__ import annotations

from pydantic import Field

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig


class SynchronizerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50051, metrics_port=9091), description="gRPC server"
    )
    lease_seconds: float = Field(10.0, gt=0, description="a component silent this long is marked STOPPED, in seconds")
    keep_versions: int = Field(2, ge=1, description="committed weight versions held in memory")
