"""Configuration of the Tinker gateway (free of heavy imports: `--help` answers at once)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig

#: The SDK gives up on a retrieve_future after 45 s; a long poll answers try_again before that.
SDK_RETRIEVE_TIMEOUT_SECONDS = 45.0


class TinkerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50056, metrics_port=9096),
        description="gRPC server (health only) and /metrics",
    )
    http_port: int = Field(8096, ge=0, le=65535, description="the Tinker API's HTTP port; 0 picks a free one")
    trainer_address: str = Field("127.0.0.1:50052", description="the trainer service that holds the model")
    base_model: str = Field(
        "", description="the name clients create models on (the SDK's base_model); empty: the trainer's model name"
    )
    checkpoint_dir: Path = Field(
        Path("tinker-checkpoints"),
        description="where save_weights puts a model's named checkpoints (the trainer writes them: a path it sees)",
    )
    rollout_address: str = Field(
        "", description="the rollout replica that samples the model's saved weights (the gateway's alone); "
        "empty: sampling is not served"
    )
    sampler_dir: Path = Field(
        Path("tinker-sampler"),
        description="where saves for the sampler export the merged weights: a path the trainer may write and inside "
        "the rollout's updates.checkpoint_root",
    )
    long_poll_seconds: float = Field(
        30.0, gt=0, lt=SDK_RETRIEVE_TIMEOUT_SECONDS, description="how long a retrieve_future waits before try_again"
    )
    session_timeout_seconds: float = Field(
        120.0, gt=0, description="a session without a heartbeat for this long has finished (the SDK beats every 10 s)"
    )
    trainer_timeout_seconds: float = Field(600.0, gt=0, description="deadline of one trainer call")
    wait_seconds: float = Field(
        1800.0, gt=0, description="how long the gateway waits at start for its trainer and rollout to answer, "
        "their models loaded"
    )
    sampler_keep_unnamed: int = Field(
        3, ge=1, description="how many unnamed saves for the sampler (save_weights_and_get_sampling_client's, one per "
        "RL step) a model keeps on disk: older ones are removed at its next save (named ones stay until deleted or "
        "expired)"
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="the largest request body, in bytes, as sent and once decompressed "
        "(zstd): larger is refused with 413 (the SDK's forward_backward chunks are 5 MB at most)"
    )
    forget_seconds: float = Field(
        3600.0, gt=0, description="how long after a session ends the gateway forgets it, with its models' and "
        "samplers' state (their saves on disk stay)"
    )
    prune_seconds: float = Field(
        30.0, gt=0, description="how often ended sessions are retired and forgotten and expired saves removed, in "
        "seconds"
    )
