"""Configuration of the synchronizer service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from flywheel.runtime.config import StrictModel, checkpoint_root_field
from flywheel.synchronizer.presence_config import PresenceConfig
from flywheel.synchronizer.types import SyncMethodName, SyncStyleName
from flywheel.runtime.server_config import ServerConfig


class PolicyConfig(StrictModel):
    """The sync policy in force until a controller calls ConfigurePolicy (a
    policy persisted in the store wins over this after a restart)."""

    style: SyncStyleName = Field("fixed", description="when rollouts sync")
    method: SyncMethodName = Field("memory", description="how weights travel")
    interval: int = Field(
        1, ge=1, description="FIXED: sync every this many steps; DYNAMIC: ask after this many, in steps"
    )
    offset: int = Field(0, ge=0, description="FIXED: steps the rollout side runs ahead before its first sync")
    timeout_seconds: float = Field(60.0, gt=0, description="DYNAMIC: a sync request lapses after this long, in seconds")


class RelayConfig(PresenceConfig):
    """Relay mode (services.synchronizer.relay): this synchronizer caches a far site's versions from
    `upstream` and serves them to the site's replicas; the shared fields (advertise_address,
    heartbeat, deadlines, retries) are `PresenceConfig`'s, for its registration upstream."""

    upstream: str = Field(..., min_length=1, description='"host:port" of the run\'s synchronizer, across the slow link')
    site: str = Field(
        ..., min_length=1, description="the site this relay serves: replicas whose synchronizer.site is the same "
        "pull their versions from it (found in the upstream's registry)"
    )
    component_id: str = Field("", description="id at the upstream; empty: relay-<site>-<host>-<grpc port>")


class SynchronizerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50051, metrics_port=9091), description="gRPC server"
    )
    lease_seconds: float = Field(10.0, gt=0, description="a component silent this long is marked STOPPED, in seconds")
    keep_versions: int = Field(2, ge=1, description="committed weight versions held in memory (MEMORY method)")
    delta_base_bytes: int = Field(
        2 << 30, ge=0, description="bytes of versions kept past keep_versions because a live replica serves them "
        "(leases: its next version can then be sent as a delta from them; past this a replica is sent the full "
        "version), in bytes; 0 keeps exactly keep_versions"
    )
    delta_cache_bytes: int = Field(
        1 << 30, ge=0, description="bytes of delta versions kept for replicas that pull a version as a delta from "
        "one they hold (the newest delta is kept whatever its size while it is read), in bytes"
    )
    max_concurrent_pushes: int = Field(
        2, ge=1, description="pushes staged at once; each holds up to a model's worth of memory until it ends"
    )
    shared_memory_dir: str = Field(
        "/dev/shm",
        description="memory-backed directory for versions' payloads, which rollouts on this host (or sharing "
        "the directory as a volume) then read in place instead of over gRPC; empty, or a directory that cannot "
        "hold a version: versions stay on the heap and every pull streams the bytes",
    )
    push_idle_timeout_seconds: float = Field(
        60.0, gt=0, description="a push that sends nothing for this long is aborted, in seconds"
    )
    store_path: Path | None = Field(
        None,
        description="SQLite file for component states, version metadata and the policy; "
        "unset keeps them in memory only (lost on restart)",
    )
    rendezvous_host: str = Field(
        "", description="host rollouts reach the trainer's NCCL/gloo rendezvous at; empty: the trainer's address host"
    )
    rendezvous_port_min: int = Field(29600, ge=1, le=65535, description="lowest rendezvous port handed out")
    rendezvous_port_max: int = Field(29999, ge=1, le=65535, description="highest rendezvous port handed out")
    group_backend: Literal["auto", "nccl", "gloo", "ipc"] = Field(
        "auto", description="transfer-group backend; auto: ipc when every member has the label device=cuda* and "
        "the same gpu label (one GPU: co-located), nccl when every member is on cuda, else gloo"
    )
    transfer_timeout_seconds: float = Field(
        300.0, gt=0, description="default deadline of an NCCL/gloo transfer, in seconds"
    )
    watch_queue_size: int = Field(
        1024, ge=8, description="events a Watch subscriber may fall behind before it is dropped"
    )
    sweep_interval_seconds: float = Field(
        0.2, gt=0, description="how often leases, sync-request timeouts and transfer deadlines are checked, in seconds"
    )
    checkpoint_root: Path | None = checkpoint_root_field("a registered path", "registrations")
    checkpoint_require_manifest: bool = Field(
        False, description="reject checkpoint directories without weight_manifest.pb"
    )
    checkpoint_verify_digest: bool = Field(
        False, description="re-hash checkpoint bytes against weight_manifest.pb's digest (reads the whole checkpoint)"
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="initial sync policy")
    relay: RelayConfig | None = Field(
        None, description="run as a far site's relay of another synchronizer's versions (pushes, checkpoints and "
        "NCCL groups are then refused: replicas register with the upstream); unset: the run's synchronizer"
    )
    keep_update_results: int = Field(
        16, ge=1, description="versions whose per-replica update results (ReportUpdate) are kept for ListUpdates"
    )

    @model_validator(mode="after")
    def _ports_ordered(self) -> SynchronizerConfig:
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError(
                f"rendezvous_port_min ({self.rendezvous_port_min}) is above "
                f"rendezvous_port_max ({self.rendezvous_port_max})"
            )
        return self
