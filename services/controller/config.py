"""Configuration of the controller service."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig


class ControllerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50054, metrics_port=9094), description="gRPC server"
    )
    runs_dir: Path = Field(Path("runs"), description="parent of each run's directory (logs, metrics, checkpoints)")
    status_port: int = Field(
        8080, ge=0, le=65535,
        description="HTTP port of the status page (components, versions, curves, timeline, errors; read-only) "
        "on server.host; 0 picks a free one. With tokens configured its JSON needs a viewer token or above, "
        "which the page takes from its URL's fragment (/#token=...)",
    )
