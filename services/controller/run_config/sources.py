"""Where a run's services, model and data come from: the `services`, `model` and `data` sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from flywheel.runtime.config import StrictModel


class ServiceEndpoint(StrictModel):
    address: str = Field(description="gRPC address host:port")
    id: str = Field(
        "", description="the component id the service registers with at the synchronizer (a rollout's "
        "synchronizer.component_id): the name of a rollout replica in NCCL groups and logs; default: its address"
    )
    timeout_seconds: float = Field(30.0, gt=0, description="default deadline of a call, in seconds")


class ServicesConfig(StrictModel):
    trainer: ServiceEndpoint = Field(
        default_factory=lambda: ServiceEndpoint(address="127.0.0.1:50052", timeout_seconds=600.0),
        description="the trainer service",
    )
    rollout: list[ServiceEndpoint] = Field(
        default_factory=list,
        description="a filter on the rollout replicas registered with the synchronizer (by id or address); "
        "empty: every registered rollout. Requests are balanced over the healthy ones",
    )
    rollout_timeout_seconds: float = Field(
        900.0, gt=0, description="deadline of a call to a rollout replica found in the synchronizer's registry and "
        "not listed in services.rollout (a generation, including its wait for the weights its step needs), in seconds"
    )
    wait_for_rollout_seconds: float = Field(
        600.0, gt=0, description="how long the run waits for a rollout replica to serve, at start (with a "
        "synchronizer: to register and serve) and whenever every replica is down, in seconds; then it stops"
    )
    synchronizer: ServiceEndpoint = Field(
        default_factory=lambda: ServiceEndpoint(address="127.0.0.1:50051"),
        description="the synchronizer: every run has one (it owns the weight versions and the sync policy; the "
        "trainer publishes to it and the replicas follow it; the local launcher starts one)",
    )
    trainer_id: str = Field("trainer-0", description="component id of the trainer at the synchronizer")
    health_interval_seconds: float = Field(5.0, gt=0, description="period of gRPC health checks, in seconds")
    auth_token_file: Path | None = Field(None, description="bearer token file; falls back to env FLYWHEEL_AUTH_TOKEN")


class ModelConfig(StrictModel):
    name: str = Field("", description="model name or path (informational; the services load it)")
    tag: str = Field("default", description="model tag trajectories are pooled under")


class LoaderConfig(StrictModel):
    format: Literal["jsonl", "parquet", "list", "hf"] | None = Field(
        None, description="source format; inferred from path's suffix, or 'list' with items"
    )
    path: Path | None = Field(None, description="JSONL or Parquet file")
    items: list[dict[str, Any]] | None = Field(None, description="rows given inline")
    hf_name: str | None = Field(None, description="a Hugging Face dataset name (needs `datasets`)")
    hf_split: str = Field("train", description="split of hf_name")
    prompt_key: str = Field("prompt", description="row field holding the prompt (text or chat messages)")
    answer_key: str | None = Field("answer", description="row field holding the reference answer")
    shuffle: bool = Field(True, description="shuffle each epoch (seeded by run.seed + epoch)")
    limit: int | None = Field(None, ge=1, description="use only the first N rows")

    @model_validator(mode="after")
    def _one_source(self) -> LoaderConfig:
        given = [name for name in ("path", "items", "hf_name") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of path, items, hf_name must be set (got {given or 'none'})")
        return self


class DataConfig(StrictModel):
    train: LoaderConfig = Field(description="training tasks")
    validation: LoaderConfig | None = Field(None, description="validation tasks (read in order, once per validation)")
    epochs: int = Field(1, ge=1, description="passes over the training data")
    drop_last: bool = Field(True, description="drop a final batch smaller than algorithm.train_batch_size")
