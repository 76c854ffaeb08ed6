from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_UINT16: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_UINT64: _ClassVar[DType]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_XXH3: _ClassVar[ChecksumAlgorithm]

class ComponentRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPONENT_ROLE_UNSPECIFIED: _ClassVar[ComponentRole]
    COMPONENT_ROLE_TRAINER: _ClassVar[ComponentRole]
    COMPONENT_ROLE_ROLLOUT: _ClassVar[ComponentRole]
    COMPONENT_ROLE_CONTROLLER: _ClassVar[ComponentRole]
    COMPONENT_ROLE_SYNCHRONIZER: _ClassVar[ComponentRole]

class ComponentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPONENT_STATE_UNSPECIFIED: _ClassVar[ComponentState]
    COMPONENT_STATE_STOPPED: _ClassVar[ComponentState]
    COMPONENT_STATE_RUNNING: _ClassVar[ComponentState]
    COMPONENT_STATE_REQUIRE_SYNC: _ClassVar[ComponentState]
    COMPONENT_STATE_WAITING_SYNC: _ClassVar[ComponentState]

class SyncMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_METHOD_UNSPECIFIED: _ClassVar[SyncMethod]
    SYNC_METHOD_NCCL: _ClassVar[SyncMethod]
    SYNC_METHOD_MEMORY: _ClassVar[SyncMethod]
    SYNC_METHOD_CHECKPOINT: _ClassVar[SyncMethod]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]

class SyncStyle(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_STYLE_UNSPECIFIED: _ClassVar[SyncStyle]
    SYNC_STYLE_FIXED: _ClassVar[SyncStyle]
    SYNC_STYLE_DYNAMIC_BY_EXPLORER: _ClassVar[SyncStyle]

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_UNSPECIFIED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
DTYPE_BOOL: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_UINT16: DType
DTYPE_UINT32: DType
DTYPE_UINT64: DType
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_XXH3: ChecksumAlgorithm
COMPONENT_ROLE_UNSPECIFIED: ComponentRole
COMPONENT_ROLE_TRAINER: ComponentRole
COMPONENT_ROLE_ROLLOUT: ComponentRole
COMPONENT_ROLE_CONTROLLER: ComponentRole
COMPONENT_ROLE_SYNCHRONIZER: ComponentRole
COMPONENT_STATE_UNSPECIFIED: ComponentState
COMPONENT_STATE_STOPPED: ComponentState
COMPONENT_STATE_RUNNING: ComponentState
COMPONENT_STATE_REQUIRE_SYNC: ComponentState
COMPONENT_STATE_WAITING_SYNC: ComponentState
SYNC_METHOD_UNSPECIFIED: SyncMethod
SYNC_METHOD_NCCL: SyncMethod
SYNC_METHOD_MEMORY: SyncMethod
SYNC_METHOD_CHECKPOINT: SyncMethod
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
SYNC_STYLE_UNSPECIFIED: SyncStyle
SYNC_STYLE_FIXED: SyncStyle
SYNC_STYLE_DYNAMIC_BY_EXPLORER: SyncStyle
LOGPROBS_MODE_UNSPECIFIED: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode
LOGPROBS_MODE_RAW: LogprobsMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "base_version", "tensors", "total_bytes", "chunk_count", "chunk_bytes", "bucket_bytes", "checksum_algorithm", "digest", "identity", "probe")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    chunk_count: int
    chunk_bytes: int
    bucket_bytes: int
    checksum_algorithm: ChecksumAlgorithm
    digest: bytes
    identity: bytes
    probe: ProbeBatch
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., digest: _Optional[bytes] = ..., identity: _Optional[bytes] = ..., probe: _Optional[_Union[ProbeBatch, _Mapping]] = ...) -> None: ...

class ProbeBatch(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ProbeSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[ProbeSequence, _Mapping]]] = ...) -> None: ...

class ProbeSequence(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "base_version", "tensor_name", "dtype", "shape", "offset", "data", "checksum", "last", "bucket_index", "sequence", "zstd")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    tensor_name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    checksum: int
    last: bool
    bucket_index: int
    sequence: int
    zstd: bool
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., tensor_name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., last: _Optional[bool] = ..., bucket_index: _Optional[int] = ..., sequence: _Optional[int] = ..., zstd: _Optional[bool] = ...) -> None: ...

class ComponentIdentity(_message.Message):
    __slots__ = ("role", "id", "address", "capabilities", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    role: ComponentRole
    id: str
    address: str
    capabilities: _containers.RepeatedScalarFieldContainer[SyncMethod]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, role: _Optional[_Union[ComponentRole, str]] = ..., id: _Optional[str] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Iterable[_Union[SyncMethod, str]]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ComponentStatus(_message.Message):
    __slots__ = ("identity", "state", "step", "weight_version", "last_heartbeat_unix_ms", "weight_identity", "quarantined", "quarantine_reason")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    identity: ComponentIdentity
    state: ComponentState
    step: int
    weight_version: int
    last_heartbeat_unix_ms: int
    weight_identity: bytes
    quarantined: bool
    quarantine_reason: str
    def __init__(self, identity: _Optional[_Union[ComponentIdentity, _Mapping]] = ..., state: _Optional[_Union[ComponentState, str]] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., weight_identity: _Optional[bytes] = ..., quarantined: _Optional[bool] = ..., quarantine_reason: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "top_logprobs", "min_tokens", "repetition_penalty", "ignore_eos", "logprobs_mode", "prompt_logprobs")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    top_logprobs: int
    min_tokens: int
    repetition_penalty: float
    ignore_eos: bool
    logprobs_mode: LogprobsMode
    prompt_logprobs: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class SampledDistribution(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "penalised")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PENALISED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    penalised: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., penalised: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "finish_reason", "stop_reason", "weight_version_start", "weight_version_end", "text", "top_logprobs", "index", "logprobs_distribution", "prompt_logprobs", "weight_version_spans", "kept_sets", "routed_experts", "adapter_identity")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_START_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_END_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    KEPT_SETS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    stop_reason: str
    weight_version_start: int
    weight_version_end: int
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    index: int
    logprobs_distribution: SampledDistribution
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    kept_sets: _containers.RepeatedCompositeFieldContainer[KeptSet]
    routed_experts: Tensor
    adapter_identity: bytes
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., weight_version_start: _Optional[int] = ..., weight_version_end: _Optional[int] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., logprobs_distribution: _Optional[_Union[SampledDistribution, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., weight_version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., kept_sets: _Optional[_Iterable[_Union[KeptSet, _Mapping]]] = ..., routed_experts: _Optional[_Union[Tensor, _Mapping]] = ..., adapter_identity: _Optional[bytes] = ...) -> None: ...

class KeptSet(_message.Message):
    __slots__ = ("position", "size", "token_ids", "constrained")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    position: int
    size: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    constrained: bool
    def __init__(self, position: _Optional[int] = ..., size: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., constrained: _Optional[bool] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[_Iterable[str]] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
