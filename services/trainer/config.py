"""Configuration of the trainer service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig


class ModelConfig(StrictModel):
    path: Path | None = Field(None, description="HF model directory to train; none serves GetInfo only")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description='torch device, e.g. "cpu" or "cuda:0"')


class TrainerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50052, metrics_port=9092), description="gRPC server"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    checkpoint_dir: Path = Field(Path("checkpoints"), description="where global_step_N/ directories are written")
