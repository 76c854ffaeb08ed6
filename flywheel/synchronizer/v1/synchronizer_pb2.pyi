from flywheel.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STATE_CHANGED: _ClassVar[EventKind]
    EVENT_KIND_VERSION_COMMITTED: _ClassVar[EventKind]
    EVENT_KIND_COMPONENT_REGISTERED: _ClassVar[EventKind]
    EVENT_KIND_COMPONENT_EXPIRED: _ClassVar[EventKind]
    EVENT_KIND_TRANSFER_STARTED: _ClassVar[EventKind]
    EVENT_KIND_TRANSFER_FINISHED: _ClassVar[EventKind]
    EVENT_KIND_SYNC_REQUESTED: _ClassVar[EventKind]
    EVENT_KIND_PUSH_REQUESTED: _ClassVar[EventKind]
    EVENT_KIND_VERSION_STAGED: _ClassVar[EventKind]
    EVENT_KIND_REWOUND: _ClassVar[EventKind]
    EVENT_KIND_UPDATE_REPORTED: _ClassVar[EventKind]
    EVENT_KIND_VERSION_REQUESTED: _ClassVar[EventKind]

class RolloutWait(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_WAIT_UNSPECIFIED: _ClassVar[RolloutWait]
    ROLLOUT_WAIT_NONE: _ClassVar[RolloutWait]
    ROLLOUT_WAIT_DUE_VERSION: _ClassVar[RolloutWait]
    ROLLOUT_WAIT_STALENESS: _ClassVar[RolloutWait]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PENDING: _ClassVar[TransferState]
    TRANSFER_STATE_COMMITTED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]

class UpdateOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_OUTCOME_UNSPECIFIED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_VERIFIED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_FAILED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_UNVERIFIED: _ClassVar[UpdateOutcome]

class ProbeStatistic(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_STATISTIC_UNSPECIFIED: _ClassVar[ProbeStatistic]
    PROBE_STATISTIC_MAX: _ClassVar[ProbeStatistic]
    PROBE_STATISTIC_MEDIAN: _ClassVar[ProbeStatistic]

class UpdatePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_PHASE_UNSPECIFIED: _ClassVar[UpdatePhase]
    UPDATE_PHASE_ADMIT: _ClassVar[UpdatePhase]
    UPDATE_PHASE_TRANSFER: _ClassVar[UpdatePhase]
    UPDATE_PHASE_APPLY: _ClassVar[UpdatePhase]
    UPDATE_PHASE_VERIFY: _ClassVar[UpdatePhase]
    UPDATE_PHASE_REOPEN: _ClassVar[UpdatePhase]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STATE_CHANGED: EventKind
EVENT_KIND_VERSION_COMMITTED: EventKind
EVENT_KIND_COMPONENT_REGISTERED: EventKind
EVENT_KIND_COMPONENT_EXPIRED: EventKind
EVENT_KIND_TRANSFER_STARTED: EventKind
EVENT_KIND_TRANSFER_FINISHED: EventKind
EVENT_KIND_SYNC_REQUESTED: EventKind
EVENT_KIND_PUSH_REQUESTED: EventKind
EVENT_KIND_VERSION_STAGED: EventKind
EVENT_KIND_REWOUND: EventKind
EVENT_KIND_UPDATE_REPORTED: EventKind
EVENT_KIND_VERSION_REQUESTED: EventKind
ROLLOUT_WAIT_UNSPECIFIED: RolloutWait
ROLLOUT_WAIT_NONE: RolloutWait
ROLLOUT_WAIT_DUE_VERSION: RolloutWait
ROLLOUT_WAIT_STALENESS: RolloutWait
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PENDING: TransferState
TRANSFER_STATE_COMMITTED: TransferState
TRANSFER_STATE_ABORTED: TransferState
UPDATE_OUTCOME_UNSPECIFIED: UpdateOutcome
UPDATE_OUTCOME_VERIFIED: UpdateOutcome
UPDATE_OUTCOME_FAILED: UpdateOutcome
UPDATE_OUTCOME_UNVERIFIED: UpdateOutcome
PROBE_STATISTIC_UNSPECIFIED: ProbeStatistic
PROBE_STATISTIC_MAX: ProbeStatistic
PROBE_STATISTIC_MEDIAN: ProbeStatistic
UPDATE_PHASE_UNSPECIFIED: UpdatePhase
UPDATE_PHASE_ADMIT: UpdatePhase
UPDATE_PHASE_TRANSFER: UpdatePhase
UPDATE_PHASE_APPLY: UpdatePhase
UPDATE_PHASE_VERIFY: UpdatePhase
UPDATE_PHASE_REOPEN: UpdatePhase

class RegisterRequest(_message.Message):
    __slots__ = ("identity", "step", "weight_version", "weight_identity")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    identity: _common_pb2.ComponentIdentity
    step: int
    weight_version: int
    weight_identity: bytes
    def __init__(self, identity: _Optional[_Union[_common_pb2.ComponentIdentity, _Mapping]] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., weight_identity: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_seconds", "state", "latest_version", "push_requested")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    state: _common_pb2.ComponentState
    latest_version: int
    push_requested: bool
    def __init__(self, lease_seconds: _Optional[float] = ..., state: _Optional[_Union[_common_pb2.ComponentState, str]] = ..., latest_version: _Optional[int] = ..., push_requested: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "step", "weight_version")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    step: int
    weight_version: int
    def __init__(self, id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state", "latest_version", "push_requested")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.ComponentState
    latest_version: int
    push_requested: bool
    def __init__(self, state: _Optional[_Union[_common_pb2.ComponentState, str]] = ..., latest_version: _Optional[int] = ..., push_requested: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStateRequest(_message.Message):
    __slots__ = ("id", "state", "expected_state", "weight_version", "reason", "weight_identity")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: _common_pb2.ComponentState
    expected_state: _common_pb2.ComponentState
    weight_version: int
    reason: str
    weight_identity: bytes
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.ComponentState, str]] = ..., expected_state: _Optional[_Union[_common_pb2.ComponentState, str]] = ..., weight_version: _Optional[int] = ..., reason: _Optional[str] = ..., weight_identity: _Optional[bytes] = ...) -> None: ...

class SetStateResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.ComponentState
    def __init__(self, state: _Optional[_Union[_common_pb2.ComponentState, str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("ids", "send_initial")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SEND_INITIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    send_initial: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., send_initial: _Optional[bool] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("kind", "component", "latest_version", "method", "location", "sequence", "unix_ms", "version", "group", "transfer_state", "message", "epoch", "rewound_to", "identity", "update")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REWOUND_TO_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    component: _common_pb2.ComponentStatus
    latest_version: int
    method: _common_pb2.SyncMethod
    location: str
    sequence: int
    unix_ms: int
    version: int
    group: AllocateGroupResponse
    transfer_state: TransferState
    message: str
    epoch: int
    rewound_to: int
    identity: bytes
    update: UpdateRecord
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., component: _Optional[_Union[_common_pb2.ComponentStatus, _Mapping]] = ..., latest_version: _Optional[int] = ..., method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., location: _Optional[str] = ..., sequence: _Optional[int] = ..., unix_ms: _Optional[int] = ..., version: _Optional[int] = ..., group: _Optional[_Union[AllocateGroupResponse, _Mapping]] = ..., transfer_state: _Optional[_Union[TransferState, str]] = ..., message: _Optional[str] = ..., epoch: _Optional[int] = ..., rewound_to: _Optional[int] = ..., identity: _Optional[bytes] = ..., update: _Optional[_Union[UpdateRecord, _Mapping]] = ...) -> None: ...

class ConfigurePolicyRequest(_message.Message):
    __slots__ = ("style", "method", "sync_interval", "sync_offset", "sync_timeout_seconds", "rollout_wait", "max_staleness", "pause_mode")
    STYLE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SYNC_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SYNC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SYNC_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_WAIT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    style: _common_pb2.SyncStyle
    method: _common_pb2.SyncMethod
    sync_interval: int
    sync_offset: int
    sync_timeout_seconds: float
    rollout_wait: RolloutWait
    max_staleness: int
    pause_mode: _common_pb2.PauseMode
    def __init__(self, style: _Optional[_Union[_common_pb2.SyncStyle, str]] = ..., method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., sync_interval: _Optional[int] = ..., sync_offset: _Optional[int] = ..., sync_timeout_seconds: _Optional[float] = ..., rollout_wait: _Optional[_Union[RolloutWait, str]] = ..., max_staleness: _Optional[int] = ..., pause_mode: _Optional[_Union[_common_pb2.PauseMode, str]] = ...) -> None: ...

class ConfigurePolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NeedSyncRequest(_message.Message):
    __slots__ = ("id", "step")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    id: str
    step: int
    def __init__(self, id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class NeedSyncResponse(_message.Message):
    __slots__ = ("need_sync", "version", "state", "method", "latest_version", "group", "push_requested", "request_deadline_unix_ms", "policy")
    NEED_SYNC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PUSH_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    need_sync: bool
    version: int
    state: _common_pb2.ComponentState
    method: _common_pb2.SyncMethod
    latest_version: int
    group: AllocateGroupResponse
    push_requested: bool
    request_deadline_unix_ms: int
    policy: ConfigurePolicyRequest
    def __init__(self, need_sync: _Optional[bool] = ..., version: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.ComponentState, str]] = ..., method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., latest_version: _Optional[int] = ..., group: _Optional[_Union[AllocateGroupResponse, _Mapping]] = ..., push_requested: _Optional[bool] = ..., request_deadline_unix_ms: _Optional[int] = ..., policy: _Optional[_Union[ConfigurePolicyRequest, _Mapping]] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "segment", "shared_chunk", "committed")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    chunk: _common_pb2.WeightChunk
    segment: SharedSegment
    shared_chunk: SharedChunk
    committed: bool
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., shared_chunk: _Optional[_Union[SharedChunk, _Mapping]] = ..., committed: _Optional[bool] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "kept_versions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    kept_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., kept_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PullWeightsRequest(_message.Message):
    __slots__ = ("version", "wait_seconds", "at_least", "shared_memory", "base_version", "base_identity", "resume_from", "resume_digest", "compress")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    RESUME_DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    wait_seconds: float
    at_least: bool
    shared_memory: bool
    base_version: int
    base_identity: bytes
    resume_from: int
    resume_digest: bytes
    compress: bool
    def __init__(self, version: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., at_least: _Optional[bool] = ..., shared_memory: _Optional[bool] = ..., base_version: _Optional[int] = ..., base_identity: _Optional[bytes] = ..., resume_from: _Optional[int] = ..., resume_digest: _Optional[bytes] = ..., compress: _Optional[bool] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("path", "nonce", "size", "header_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    nonce: bytes
    size: int
    header_bytes: int
    def __init__(self, path: _Optional[str] = ..., nonce: _Optional[bytes] = ..., size: _Optional[int] = ..., header_bytes: _Optional[int] = ...) -> None: ...

class SharedChunk(_message.Message):
    __slots__ = ("chunk", "segment_offset", "length")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.WeightChunk
    segment_offset: int
    length: int
    def __init__(self, chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ..., segment_offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PullWeightsResponse(_message.Message):
    __slots__ = ("manifest", "chunk", "segment", "shared_chunk", "committed")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    chunk: _common_pb2.WeightChunk
    segment: SharedSegment
    shared_chunk: SharedChunk
    committed: bool
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., shared_chunk: _Optional[_Union[SharedChunk, _Mapping]] = ..., committed: _Optional[bool] = ...) -> None: ...

class RegisterCheckpointRequest(_message.Message):
    __slots__ = ("version", "path", "trainer_id", "tensors", "probe")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    trainer_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    probe: _common_pb2.ProbeBatch
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., trainer_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ..., probe: _Optional[_Union[_common_pb2.ProbeBatch, _Mapping]] = ...) -> None: ...

class TensorDigest(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class RegisterCheckpointResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("version", "path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class AllocateGroupRequest(_message.Message):
    __slots__ = ("version", "trainer_id", "rollout_ids", "timeout_seconds", "backend")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    version: int
    trainer_id: str
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    backend: str
    def __init__(self, version: _Optional[int] = ..., trainer_id: _Optional[str] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ..., backend: _Optional[str] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("id", "rank")
    ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    id: str
    rank: int
    def __init__(self, id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class AllocateGroupResponse(_message.Message):
    __slots__ = ("group_id", "rendezvous_address", "world_size", "backend", "members", "deadline_unix_ms", "version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rendezvous_address: str
    world_size: int
    backend: str
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    deadline_unix_ms: int
    version: int
    def __init__(self, group_id: _Optional[str] = ..., rendezvous_address: _Optional[str] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., deadline_unix_ms: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ReportTransferRequest(_message.Message):
    __slots__ = ("group_id", "id", "success", "error", "identity", "tensors", "probe")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    id: str
    success: bool
    error: str
    identity: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    probe: _common_pb2.ProbeBatch
    def __init__(self, group_id: _Optional[str] = ..., id: _Optional[str] = ..., success: _Optional[bool] = ..., error: _Optional[str] = ..., identity: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ..., probe: _Optional[_Union[_common_pb2.ProbeBatch, _Mapping]] = ...) -> None: ...

class ReportTransferResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("group_id", "wait_seconds")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    wait_seconds: float
    def __init__(self, group_id: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("state", "error", "group", "confirmed", "identity")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    error: str
    group: AllocateGroupResponse
    confirmed: _containers.RepeatedScalarFieldContainer[str]
    identity: bytes
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., error: _Optional[str] = ..., group: _Optional[_Union[AllocateGroupResponse, _Mapping]] = ..., confirmed: _Optional[_Iterable[str]] = ..., identity: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version", "method", "bytes", "in_memory", "path", "committed_unix_ms", "identity", "epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    method: _common_pb2.SyncMethod
    bytes: int
    in_memory: bool
    path: str
    committed_unix_ms: int
    identity: bytes
    epoch: int
    def __init__(self, version: _Optional[int] = ..., method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., bytes: _Optional[int] = ..., in_memory: _Optional[bool] = ..., path: _Optional[str] = ..., committed_unix_ms: _Optional[int] = ..., identity: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("components", "versions", "latest_version", "policy", "transfers", "held_bytes", "epoch", "rewound_to")
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REWOUND_TO_FIELD_NUMBER: _ClassVar[int]
    components: _containers.RepeatedCompositeFieldContainer[_common_pb2.ComponentStatus]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    latest_version: int
    policy: ConfigurePolicyRequest
    transfers: _containers.RepeatedCompositeFieldContainer[GetTransferResponse]
    held_bytes: int
    epoch: int
    rewound_to: int
    def __init__(self, components: _Optional[_Iterable[_Union[_common_pb2.ComponentStatus, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., latest_version: _Optional[int] = ..., policy: _Optional[_Union[ConfigurePolicyRequest, _Mapping]] = ..., transfers: _Optional[_Iterable[_Union[GetTransferResponse, _Mapping]]] = ..., held_bytes: _Optional[int] = ..., epoch: _Optional[int] = ..., rewound_to: _Optional[int] = ...) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("to_version", "reason", "start_over")
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    START_OVER_FIELD_NUMBER: _ClassVar[int]
    to_version: int
    reason: str
    start_over: bool
    def __init__(self, to_version: _Optional[int] = ..., reason: _Optional[str] = ..., start_over: _Optional[bool] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("epoch", "latest_version", "dropped_versions", "rewinding")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWINDING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    latest_version: int
    dropped_versions: _containers.RepeatedScalarFieldContainer[int]
    rewinding: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., latest_version: _Optional[int] = ..., dropped_versions: _Optional[_Iterable[int]] = ..., rewinding: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateCoverage(_message.Message):
    __slots__ = ("tensors", "bytes", "resident_tensors", "resident_bytes", "received_tensors", "received_bytes", "probe")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TENSORS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    bytes: int
    resident_tensors: int
    resident_bytes: int
    received_tensors: int
    received_bytes: int
    probe: ProbeCheck
    def __init__(self, tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., resident_tensors: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., received_tensors: _Optional[int] = ..., received_bytes: _Optional[int] = ..., probe: _Optional[_Union[ProbeCheck, _Mapping]] = ...) -> None: ...

class ProbeCheck(_message.Message):
    __slots__ = ("ran", "tokens", "max_abs_diff", "mean_abs_diff", "tolerance", "passed", "median_abs_diff", "statistic")
    RAN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    STATISTIC_FIELD_NUMBER: _ClassVar[int]
    ran: bool
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float
    passed: bool
    median_abs_diff: float
    statistic: ProbeStatistic
    def __init__(self, ran: _Optional[bool] = ..., tokens: _Optional[int] = ..., max_abs_diff: _Optional[float] = ..., mean_abs_diff: _Optional[float] = ..., tolerance: _Optional[float] = ..., passed: _Optional[bool] = ..., median_abs_diff: _Optional[float] = ..., statistic: _Optional[_Union[ProbeStatistic, str]] = ...) -> None: ...

class UpdateTimings(_message.Message):
    __slots__ = ("admit_seconds", "transfer_seconds", "apply_seconds", "verify_seconds", "reopen_seconds", "pause_seconds", "prepare_seconds")
    ADMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REOPEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    admit_seconds: float
    transfer_seconds: float
    apply_seconds: float
    verify_seconds: float
    reopen_seconds: float
    pause_seconds: float
    prepare_seconds: float
    def __init__(self, admit_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., reopen_seconds: _Optional[float] = ..., pause_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ...) -> None: ...

class UpdateRecord(_message.Message):
    __slots__ = ("component_id", "version", "expected_identity", "resident_identity", "outcome", "failed_phase", "reason", "timings", "unix_ms", "epoch", "served_version", "coverage")
    COMPONENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FAILED_PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    component_id: str
    version: int
    expected_identity: bytes
    resident_identity: bytes
    outcome: UpdateOutcome
    failed_phase: UpdatePhase
    reason: str
    timings: UpdateTimings
    unix_ms: int
    epoch: int
    served_version: int
    coverage: UpdateCoverage
    def __init__(self, component_id: _Optional[str] = ..., version: _Optional[int] = ..., expected_identity: _Optional[bytes] = ..., resident_identity: _Optional[bytes] = ..., outcome: _Optional[_Union[UpdateOutcome, str]] = ..., failed_phase: _Optional[_Union[UpdatePhase, str]] = ..., reason: _Optional[str] = ..., timings: _Optional[_Union[UpdateTimings, _Mapping]] = ..., unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., served_version: _Optional[int] = ..., coverage: _Optional[_Union[UpdateCoverage, _Mapping]] = ...) -> None: ...

class ReportUpdateRequest(_message.Message):
    __slots__ = ("id", "version", "resident_identity", "outcome", "failed_phase", "reason", "timings", "served_version", "coverage")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FAILED_PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SERVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    version: int
    resident_identity: bytes
    outcome: UpdateOutcome
    failed_phase: UpdatePhase
    reason: str
    timings: UpdateTimings
    served_version: int
    coverage: UpdateCoverage
    def __init__(self, id: _Optional[str] = ..., version: _Optional[int] = ..., resident_identity: _Optional[bytes] = ..., outcome: _Optional[_Union[UpdateOutcome, str]] = ..., failed_phase: _Optional[_Union[UpdatePhase, str]] = ..., reason: _Optional[str] = ..., timings: _Optional[_Union[UpdateTimings, _Mapping]] = ..., served_version: _Optional[int] = ..., coverage: _Optional[_Union[UpdateCoverage, _Mapping]] = ...) -> None: ...

class ReportUpdateResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: UpdateRecord
    def __init__(self, record: _Optional[_Union[UpdateRecord, _Mapping]] = ...) -> None: ...

class ListUpdatesRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ListUpdatesResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[UpdateRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[UpdateRecord, _Mapping]]] = ...) -> None: ...

class RequestVersionRequest(_message.Message):
    __slots__ = ("min_version", "reason")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    reason: str
    def __init__(self, min_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RequestVersionResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version", "identity", "tensors", "probe", "epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    identity: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    probe: _common_pb2.ProbeBatch
    epoch: int
    def __init__(self, version: _Optional[int] = ..., identity: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ..., probe: _Optional[_Union[_common_pb2.ProbeBatch, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...
