"""The `server` section every service's config has: where it listens, how it
authenticates, logs and shuts down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from flywheel.runtime.config import StrictModel
from flywheel.runtime.tls import TlsConfig

MIB = 1024 * 1024


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="interface to listen on; 0.0.0.0 in containers")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one (see ready_file)")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics HTTP port; 0 picks a free one")
    metrics_host: str | None = Field(
        None, description="interface /metrics listens on (e.g. a cluster-internal one); unset: host"
    )
    metrics_auth: bool = Field(
        False, description="/metrics (the metrics port, and the rollout's HTTP /metrics) needs a bearer token "
        "of any scope, like the RPCs; give the scraper a viewer token"
    )
    auth_token: SecretStr | None = Field(
        None, description="bearer token clients must send; falls back to env FLYWHEEL_AUTH_TOKEN, then none (auth off)"
    )
    auth_token_file: Path | None = Field(
        None, description="file holding the bearer token; falls back to env FLYWHEEL_AUTH_TOKEN_FILE"
    )
    tokens_file: Path | None = Field(
        None, description="YAML file of scoped tokens, {viewer|agent|service|operator: token or [tokens]} (python -m "
        "flywheel.runtime.tokens init FILE writes one); falls back to env FLYWHEEL_TOKENS_FILE. auth_token keeps meaning scope operator. This service calls the others with its "
        "service token",
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="TLS for every listener and call (flywheel.runtime.tls)")
    max_message_bytes: int = Field(
        64 * MIB, ge=4 * MIB, description="largest gRPC message sent or received, in bytes (clients use the same)"
    )
    shutdown_grace_seconds: float = Field(
        10.0, ge=0, description="time in-flight RPCs get to finish after SIGTERM, in seconds"
    )
    ready_file: Path | None = Field(
        None, description="once SERVING, write {pid, grpc_port, metrics_port} as JSON here (for launchers and tests)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["json", "text"] = Field("json", description="json lines (for collectors) or text")
