"""What `SynchronizerClient` returns: typed results built from the responses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flywheel.codec.identity import VersionIdentity
from flywheel.probe import ProbeBatch

from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.convert import (
    component_from_pb, group_from_pb, policy_from_status_pb, tensor_digests_to_pb, update_from_pb,
)
from flywheel.synchronizer.types import (
    Component, EventKind, GroupInfo, Method, Policy, State, TransferState, UpdateRecord,
)


def _method(value: int) -> Method | None:
    return Method(value) if value else None


@dataclass(frozen=True)
class VersionProof:
    """What a committed version is, as the synchronizer recorded it at its commit (GetVersion):
    what a replica verifies the weights it loaded against."""

    version: int
    #: Its identity and each tensor's digest (`tensors` empty: the publisher sent none).
    identity: VersionIdentity
    #: The trainer's probe of the version (None: none was published).
    probe: ProbeBatch | None
    #: The lineage it was committed in.
    epoch: int = 0

    @classmethod
    def from_pb(cls, r: pb.GetVersionResponse) -> VersionProof:
        tensors = {t.name: bytes(t.digest) for t in r.tensors}
        return cls(r.version, VersionIdentity(bytes(r.identity), tensors), ProbeBatch.from_pb(r.probe), r.epoch)

    def to_pb(self) -> pb.GetVersionResponse:
        r = pb.GetVersionResponse(version=self.version, identity=self.identity.digest,
                                  tensors=tensor_digests_to_pb(self.identity.tensors), epoch=self.epoch)
        if self.probe is not None:
            r.probe.CopyFrom(self.probe.to_pb())
        return r


@dataclass(frozen=True)
class Registration:
    #: Heartbeat at least this often, in seconds.
    lease_seconds: float
    state: State
    latest_version: int
    #: MEMORY trainers: the synchronizer lost the newest version's bytes; push again.
    push_requested: bool


@dataclass(frozen=True)
class Beat:
    state: State
    latest_version: int
    push_requested: bool


@dataclass(frozen=True)
class SyncDecision:
    need_sync: bool
    #: Trainer: the version to publish; rollout: the lowest version to move to.
    version: int
    state: State
    method: Method | None
    latest_version: int
    #: NCCL: the pending transfer this component takes part in.
    group: GroupInfo | None
    push_requested: bool
    #: DYNAMIC rollouts: when the sync request lapses, ms since the epoch (0: none).
    request_deadline_unix_ms: int
    #: The active policy (None from a synchronizer that does not send it).
    policy: Policy | None = None

    @classmethod
    def from_pb(cls, r: pb.NeedSyncResponse) -> SyncDecision:
        return cls(
            r.need_sync, r.version, State(r.state), _method(r.method), r.latest_version,
            group_from_pb(r.group) if r.HasField("group") else None, r.push_requested, r.request_deadline_unix_ms,
            policy_from_status_pb(r.policy) if r.HasField("policy") else None,
        )


@dataclass(frozen=True)
class Rewind:
    #: The lineage after it (rewinds so far).
    epoch: int
    latest_version: int
    #: The versions dropped, oldest first.
    dropped: list[int]
    #: Rollouts that served a newer version and go back.
    rewinding: list[str]

    @classmethod
    def from_pb(cls, r: pb.RewindResponse) -> Rewind:
        return cls(r.epoch, r.latest_version, list(r.dropped_versions), list(r.rewinding))


@dataclass(frozen=True)
class PushResult:
    version: int
    nbytes: int
    #: Versions held after the commit, oldest first.
    kept_versions: list[int]


@dataclass(frozen=True)
class DeltaBase:
    """A verified version a reader holds on the host, offered as the base of a delta pull."""

    version: int
    identity: VersionIdentity
    #: CPU tensors of that version, only read.
    tensors: Mapping[str, torch.Tensor]


@dataclass
class PullStats:
    """What one pull cost on the wire (filled in by the pull)."""

    #: Chunk payload bytes received over the stream, resumed attempts included.
    stream_bytes: int = 0
    #: Chunk payload bytes read in place from the synchronizer's shared memory.
    shared_bytes: int = 0
    #: Times the stream was cut and resumed.
    resumes: int = 0
    #: The version arrived as a delta from this base (0: in full).
    delta_base: int = 0
    #: Compressed chunks were asked for (the link to the synchronizer proved slow, or the caller asked).
    compressed: bool = False


@dataclass(frozen=True)
class PulledWeights:
    version: int
    #: The destination tensors (updated in place) or fresh CPU tensors.
    tensors: dict[str, torch.Tensor]
    nbytes: int
    #: The version's identity as its manifest carries it (None: a publisher without identities).
    identity: VersionIdentity | None = None
    #: Bytes it cost on the wire, resumes, and whether it came as a delta.
    stats: PullStats | None = None


@dataclass(frozen=True)
class TransferOutcome:
    state: TransferState
    error: str
    group: GroupInfo | None
    confirmed: list[str]
    #: The identity rank 0 reported for the weights it sent (b"" until it did).
    identity: bytes = b""

    @classmethod
    def from_pb(cls, r: pb.GetTransferResponse) -> TransferOutcome:
        state = TransferState(r.state) if r.state else TransferState.PENDING
        return cls(state, r.error, group_from_pb(r.group) if r.HasField("group") else None, list(r.confirmed),
                   r.identity)


@dataclass(frozen=True)
class WatchEvent:
    kind: EventKind
    sequence: int
    unix_ms: int
    latest_version: int
    component: Component | None
    version: int
    method: Method | None
    location: str
    group: GroupInfo | None
    transfer_state: TransferState | None
    message: str
    #: Rewinds so far, and the version the last one went back to (0: none).
    epoch: int = 0
    rewound_to: int = 0
    #: VERSION_COMMITTED, TRANSFER_FINISHED: the version's identity (b"": none).
    identity: bytes = b""
    #: UPDATE_REPORTED: the result as recorded.
    update: UpdateRecord | None = None

    @classmethod
    def from_pb(cls, r: pb.WatchResponse) -> WatchEvent:
        return cls(
            EventKind(r.kind), r.sequence, r.unix_ms, r.latest_version,
            component_from_pb(r.component) if r.HasField("component") else None, r.version, _method(r.method),
            r.location, group_from_pb(r.group) if r.HasField("group") else None,
            TransferState(r.transfer_state) if r.transfer_state else None, r.message, r.epoch, r.rewound_to,
            r.identity, update_from_pb(r.update) if r.HasField("update") else None,
        )


@dataclass(frozen=True)
class VersionInfo:
    version: int
    method: Method | None
    nbytes: int
    in_memory: bool
    path: str
    committed_unix_ms: int
    #: The version's identity (b"": none recorded) and the lineage it was committed in.
    identity: bytes = b""
    epoch: int = 0


@dataclass(frozen=True)
class SyncStatus:
    components: list[Component]
    versions: list[VersionInfo]
    latest_version: int
    policy: Policy
    transfers: list[TransferOutcome]
    held_bytes: int
    #: Rewinds so far, and the version the last one went back to (0: none).
    epoch: int = 0
    rewound_to: int = 0

    @classmethod
    def from_pb(cls, r: pb.StatusResponse) -> SyncStatus:
        return cls(
            [component_from_pb(c) for c in r.components],
            [
                VersionInfo(v.version, _method(v.method), v.bytes, v.in_memory, v.path, v.committed_unix_ms,
                            v.identity, v.epoch)
                for v in r.versions
            ],
            r.latest_version, policy_from_status_pb(r.policy), [TransferOutcome.from_pb(t) for t in r.transfers], r.held_bytes,
            r.epoch, r.rewound_to,
        )

    def component(self, component_id: str) -> Component | None:
        return next((c for c in self.components if c.id == component_id), None)

    def version(self, version: int) -> VersionInfo | None:
        return next((v for v in self.versions if v.version == version), None)

    def describe(self) -> str:
        """A plain-text table for the CLI and logs."""
        p = self.policy
        lines = [
            f"policy: {p.style.name.lower()} interval={p.interval} offset={p.offset} "
            f"method={p.method.name.lower()} timeout={p.timeout_seconds:g}s",
            f"latest version: {self.latest_version}   weights held: {self.held_bytes / 2**20:.1f} MiB",
            f"{'component':<24}{'role':<12}{'state':<14}{'step':>8}{'version':>9}",
        ]
        for c in self.components:
            quarantine = f"  QUARANTINED: {c.quarantine_reason}" if c.quarantined else ""
            lines.append(f"{c.id:<24}{c.role.name.lower():<12}{c.state.name:<14}{c.step:>8}{c.weight_version:>9}"
                         f"{quarantine}")
        for v in self.versions:
            where = v.path or ("in memory" if v.in_memory else "bytes not held")
            method = v.method.name.lower() if v.method else "?"
            identity = f", identity {v.identity.hex()[:16]}" if v.identity else ""
            lines.append(f"version {v.version}: {method}, {v.nbytes / 2**20:.1f} MiB, {where}{identity}")
        for t in self.transfers[-5:]:
            group = t.group.group_id if t.group else "?"
            lines.append(f"transfer {group}: {t.state.name}{' - ' + t.error if t.error else ''}")
        return "\n".join(lines)
