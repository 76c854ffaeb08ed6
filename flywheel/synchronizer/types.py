"""The synchronizer's vocabulary: roles, states, methods, styles, identities.

Plain Python (no grpc, no protobuf) so domain modules and the typed client
share it. Enum values equal the proto enums' numbers, so translating is
`State(pb_value)` one way and `int(state)` the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.probe import ProbeCheck


class Role(enum.IntEnum):
    TRAINER = 1
    ROLLOUT = 2
    CONTROLLER = 3
    #: A synchronizer in relay mode (services.synchronizer.relay): a far site's cache of versions.
    SYNCHRONIZER = 4


class State(enum.IntEnum):
    STOPPED = 1
    RUNNING = 2
    REQUIRE_SYNC = 3
    WAITING_SYNC = 4


class Method(enum.IntEnum):
    NCCL = 1
    MEMORY = 2
    CHECKPOINT = 3


#: A Method by its lower-case name, as configs spell it (and as the oneof fields of
#: ExportWeights' targets and UpdateWeights' sources are named).
SyncMethodName = Literal["memory", "checkpoint", "nccl"]


def method_name(method: Method | int) -> str:
    """The config's (and the wire oneof's) spelling of a method."""
    return Method(method).name.lower()


class Style(enum.IntEnum):
    FIXED = 1
    DYNAMIC_BY_EXPLORER = 2


#: A Style by its lower-case name, as configs spell it.
SyncStyleName = Literal["fixed", "dynamic_by_explorer"]


class RolloutWait(enum.IntEnum):
    """What a rollout replica waits for before it generates for a run step."""

    #: Never: it generates on whatever it holds (fully-async).
    NONE = 1
    #: Until it holds the version the policy makes due at its step (sync mode).
    DUE_VERSION = 2
    #: While it is more than `Policy.max_staleness` versions behind (batch-async).
    STALENESS = 3


class TransferState(enum.IntEnum):
    PENDING = 1
    COMMITTED = 2
    ABORTED = 3


class EventKind(enum.IntEnum):
    STATE_CHANGED = 1
    VERSION_COMMITTED = 2
    COMPONENT_REGISTERED = 3
    COMPONENT_EXPIRED = 4
    TRANSFER_STARTED = 5
    TRANSFER_FINISHED = 6
    SYNC_REQUESTED = 7
    PUSH_REQUESTED = 8
    VERSION_STAGED = 9
    REWOUND = 10
    UPDATE_REPORTED = 11
    VERSION_REQUESTED = 12


class UpdateOutcome(enum.IntEnum):
    """How a replica's weight update ended."""

    #: Applied, and the resident weights' identity is the version's.
    VERIFIED = 1
    #: A phase failed: the replica is quarantined until an update verifies.
    FAILED = 2
    #: Applied, nothing measured contradicts the version, but not every tensor was covered
    #: (`UpdateCoverage.complete` is False): not proof, quarantined like a failure by default.
    UNVERIFIED = 3


class UpdatePhase(enum.IntEnum):
    """The phases of a weight update on one replica, in order."""

    ADMIT = 1
    TRANSFER = 2
    APPLY = 3
    VERIFY = 4
    REOPEN = 5


#: The phases an update's timings and metrics name (`UpdateTimings.<phase>_seconds`): UpdatePhase's
#: in order, then the pause they add up to.
TIMED_PHASES: tuple[str, ...] = (*(phase.name.lower() for phase in UpdatePhase), "pause")


def parse_enum(kind: type[enum.IntEnum], value: object, what: str) -> enum.IntEnum:
    """An enum member from a member, its number or its (case-insensitive) name."""
    try:
        if isinstance(value, str):
            return kind[value.strip().upper()]
        return kind(value)
    except (KeyError, ValueError):
        names = ", ".join(m.name.lower() for m in kind)
        raise InvalidArgument(f"{what}: {value!r} is not one of {names}") from None


@dataclass(frozen=True)
class Identity:
    """Who a component is (mirrors common.v1.ComponentIdentity)."""

    role: Role
    id: str
    address: str = ""
    capabilities: frozenset[Method] = frozenset()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Component:
    """What the synchronizer knows of one component."""

    identity: Identity
    state: State = State.RUNNING
    step: int = 0
    weight_version: int = 0
    #: Wall-clock time of the last register/heartbeat, in ms since the epoch.
    last_heartbeat_ms: int = 0
    #: Monotonic time at which the lease ends.
    lease_expires: float = 0.0
    #: DYNAMIC: step at which the last satisfied sync request was made.
    last_sync_step: int = 0
    #: REQUIRE_SYNC: monotonic time the request was made, the step it was
    #: made at, and the version awaited.
    requested_at: float | None = None
    request_step: int = 0
    awaited_version: int = 0
    #: Identity of the weights held (flywheel.codec.identity; b"" when unknown).
    weight_identity: bytes = b""
    #: Rollouts: the last weight update failed; no traffic until one verifies.
    quarantined: bool = False
    quarantine_reason: str = ""

    @property
    def id(self) -> str:
        return self.identity.id

    @property
    def role(self) -> Role:
        return self.identity.role


@dataclass(frozen=True)
class Policy:
    """The run's sync policy: when (style, interval, offset, timeout) and how (method)."""

    style: Style = Style.FIXED
    method: Method = Method.MEMORY
    interval: int = 1
    offset: int = 0
    timeout_seconds: float = 60.0
    #: What a rollout holds a generation of run step r back for.
    rollout_wait: RolloutWait = RolloutWait.NONE
    #: RolloutWait.STALENESS: the most versions its weights may lag r - 1.
    max_staleness: int = 0
    #: What a rollout does with its in-flight requests while it swaps weights
    #: (flywheel.common.types.PauseMode); "" leaves it to the rollout's own default.
    pause_mode: str = ""


@dataclass(frozen=True)
class UpdateTimings:
    """How long each phase of one weight update took, in seconds (0: not reached)."""

    admit_seconds: float = 0.0
    transfer_seconds: float = 0.0
    apply_seconds: float = 0.0
    verify_seconds: float = 0.0
    reopen_seconds: float = 0.0
    #: Generation stopped (from the gate closing, or with keep from the freeze, to the reopen): the cost users feel.
    pause_seconds: float = 0.0
    #: Of transfer_seconds: loading into a copy of the engine's weights before the pause (0: loaded inside it).
    prepare_seconds: float = 0.0

    def by_phase(self) -> dict[str, float]:
        """{phase: seconds} over TIMED_PHASES."""
        return {phase: getattr(self, f"{phase}_seconds") for phase in TIMED_PHASES}


@dataclass(frozen=True)
class UpdateCoverage:
    """What a replica measured of the weights it holds after an update, and how: RESIDENT (hashed as
    they sit in the engine), RECEIVED (hashed by the engine's loader as it consumed them, in its
    worker; counted only for tensors not also RESIDENT) and PROBE (log-probs of the version's probe
    batch against the trainer's). Counts only tensors whose measured digest equals the version's."""

    #: Tensors of the version, and their bytes.
    tensors: int = 0
    bytes: int = 0
    resident_tensors: int = 0
    resident_bytes: int = 0
    received_tensors: int = 0
    received_bytes: int = 0
    probe: ProbeCheck = field(default_factory=ProbeCheck)

    @property
    def complete(self) -> bool:
        """Every tensor covered by RESIDENT, or by RECEIVED with a passing probe: the update is proof."""
        if self.tensors == 0 or self.resident_tensors + self.received_tensors < self.tensors:
            return False
        return self.received_tensors == 0 or (self.probe.ran and self.probe.passed)

    @property
    def methods(self) -> list[str]:
        """How it was covered, in words ("resident", "received", "probe")."""
        return [name for name, used in (("resident", self.resident_tensors), ("received", self.received_tensors),
                                        ("probe", self.probe.ran)) if used]

    def describe(self) -> str:
        parts = [f"{self.resident_tensors + self.received_tensors} of {self.tensors} tensors measured "
                 f"({self.resident_tensors} resident, {self.received_tensors} as received)"]
        if self.probe.ran:
            parts.append(self.probe.describe())
        return "; ".join(parts)


@dataclass(frozen=True)
class UpdateRecord:
    """One replica's result of one weight update, with the synchronizer's verdict."""

    component_id: str
    version: int
    outcome: UpdateOutcome
    #: The version's identity as recorded (b"": none recorded).
    expected_identity: bytes = b""
    #: Measured on the resident weights (b"": failed before verification).
    resident_identity: bytes = b""
    #: FAILED: the phase that failed, and why.
    failed_phase: UpdatePhase | None = None
    reason: str = ""
    timings: UpdateTimings = field(default_factory=UpdateTimings)
    unix_ms: int = 0
    epoch: int = 0
    #: The version served after it.
    served_version: int = 0
    #: What the replica measured, and how.
    coverage: UpdateCoverage = field(default_factory=UpdateCoverage)

    @property
    def verified(self) -> bool:
        return self.outcome == UpdateOutcome.VERIFIED


@dataclass(frozen=True)
class GroupInfo:
    """A transfer's process group as participants see it (AllocateGroupResponse)."""

    group_id: str
    version: int
    #: "host:port" of rank 0's rendezvous store.
    rendezvous_address: str
    world_size: int
    #: "nccl", "gloo" or "ipc" (`flywheel.transfer.broadcast.BACKENDS`).
    backend: str
    #: Component id -> rank (the trainer is rank 0).
    ranks: dict[str, int]
    #: The transfer's deadline, in ms since the Unix epoch.
    deadline_unix_ms: int

    def rank_of(self, component_id: str) -> int:
        if component_id not in self.ranks:
            raise FailedPrecondition(f"{component_id!r} is not a member of transfer group {self.group_id!r}")
        return self.ranks[component_id]
