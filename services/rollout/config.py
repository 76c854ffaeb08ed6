"""Configuration of the rollout service."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig


class EngineConfig(StrictModel):
    kind: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="inference engine; auto picks vllm when installed, else transformers"
    )
    model_path: Path | None = Field(None, description="HF model directory to serve")
    args: dict[str, Any] = Field(
        default_factory=dict, description="engine arguments passed to vLLM untouched (e.g. {max_model_len: 1024})"
    )


class RolloutConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50053, metrics_port=9093), description="gRPC server"
    )
    http_port: int = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port; 0 picks a free one")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the inference engine")
