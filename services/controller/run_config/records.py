"""What a run keeps and reports: the `validation`, `checkpoint`, `resume`, `errors`, `metrics` and
`run` sections."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from flywheel.runtime.config import StrictModel
from services.controller.run_config.worker import SamplingConfig


class ValidationConfig(StrictModel):
    interval: int = Field(0, ge=0, description="validate every N weight versions; 0 never")
    before_training: bool = Field(False, description="validate once before the first step")
    max_samples: int | None = Field(None, ge=1, description="validate on the first N tasks only")
    group_size: int = Field(1, ge=1, description="completions per validation task")
    sampling: SamplingConfig | None = Field(None, description="sampling for validation; default greedy")
    max_in_flight: int | None = Field(
        None, ge=1,
        description="validation requests in flight at once; default all of them, so the engine batches the whole "
        "pass (training rollouts are paused meanwhile, so worker.max_in_flight does not apply)",
    )


class CheckpointConfig(StrictModel):
    interval: int = Field(0, ge=0, description="checkpoint every N steps; 0 only at the end")
    at_end: bool = Field(True, description="checkpoint when the run finishes")
    remove_previous: bool = Field(False, description="delete older checkpoints after a save")


class ResumeConfig(StrictModel):
    from_: Literal["none", "latest"] | str = Field(
        "none", alias="from", description="none | latest | a checkpoint path"
    )


class ErrorsConfig(StrictModel):
    policy: Literal["stop_on_error", "stop_on_critical", "continue"] = Field(
        "stop_on_critical", description="which recorded errors stop the run"
    )
    max_recorded: int = Field(1000, ge=1, description="errors kept for status")


class MetricsConfig(StrictModel):
    jsonl: bool = Field(True, description="write metrics.jsonl in the run directory")
    tensorboard_dir: Path | None = Field(None, description="also write TensorBoard events here (needs tensorboard)")
    wandb_project: str | None = Field(None, description="also log to this W&B project (needs wandb)")


class RunSection(StrictModel):
    name: str = Field("run", description="run name")
    seed: int = Field(0, description="seed of data shuffling and sampling")
    max_steps: int | None = Field(None, ge=1, description="stop after N trainer steps; default when data runs out")
    output_dir: Path | None = Field(None, description="run directory; default <runs_dir>/<run id>")
