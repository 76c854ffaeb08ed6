from flywheel.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_KIND_UNSPECIFIED: _ClassVar[LossKind]
    LOSS_KIND_GRPO: _ClassVar[LossKind]
    LOSS_KIND_DAPO: _ClassVar[LossKind]
    LOSS_KIND_PPO_CLIP: _ClassVar[LossKind]
    LOSS_KIND_CROSS_ENTROPY: _ClassVar[LossKind]
    LOSS_KIND_IMPORTANCE_SAMPLING: _ClassVar[LossKind]
    LOSS_KIND_CISPO: _ClassVar[LossKind]

class LossAggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_AGGREGATION_UNSPECIFIED: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_TOKEN_MEAN: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SEQ_MEAN_TOKEN_MEAN: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SUM: _ClassVar[LossAggregation]

class LogprobModel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_MODEL_UNSPECIFIED: _ClassVar[LogprobModel]
    LOGPROB_MODEL_POLICY: _ClassVar[LogprobModel]
    LOGPROB_MODEL_REFERENCE: _ClassVar[LogprobModel]
LOSS_KIND_UNSPECIFIED: LossKind
LOSS_KIND_GRPO: LossKind
LOSS_KIND_DAPO: LossKind
LOSS_KIND_PPO_CLIP: LossKind
LOSS_KIND_CROSS_ENTROPY: LossKind
LOSS_KIND_IMPORTANCE_SAMPLING: LossKind
LOSS_KIND_CISPO: LossKind
LOSS_AGGREGATION_UNSPECIFIED: LossAggregation
LOSS_AGGREGATION_TOKEN_MEAN: LossAggregation
LOSS_AGGREGATION_SEQ_MEAN_TOKEN_MEAN: LossAggregation
LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM: LossAggregation
LOSS_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM: LossAggregation
LOSS_AGGREGATION_SUM: LossAggregation
LOGPROB_MODEL_UNSPECIFIED: LogprobModel
LOGPROB_MODEL_POLICY: LogprobModel
LOGPROB_MODEL_REFERENCE: LogprobModel

class LossSpec(_message.Message):
    __slots__ = ("kind", "clip_low", "clip_high", "kl_coef", "entropy_coef", "aggregation", "is_cap", "max_response_length")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    IS_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: LossKind
    clip_low: float
    clip_high: float
    kl_coef: float
    entropy_coef: float
    aggregation: LossAggregation
    is_cap: float
    max_response_length: int
    def __init__(self, kind: _Optional[_Union[LossKind, str]] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., kl_coef: _Optional[float] = ..., entropy_coef: _Optional[float] = ..., aggregation: _Optional[_Union[LossAggregation, str]] = ..., is_cap: _Optional[float] = ..., max_response_length: _Optional[int] = ...) -> None: ...

class TrainBatch(_message.Message):
    __slots__ = ("input_ids", "attention_mask", "loss_mask", "advantages", "behaviour_logprobs", "weight_versions", "old_logprobs", "ref_logprobs", "sampling_temperature", "sampling_top_k", "sampling_top_p", "sampler_kept_size", "sampler_kept_ids", "routed_experts")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOP_K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOP_P_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_KEPT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_KEPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _common_pb2.Tensor
    attention_mask: _common_pb2.Tensor
    loss_mask: _common_pb2.Tensor
    advantages: _common_pb2.Tensor
    behaviour_logprobs: _common_pb2.Tensor
    weight_versions: _common_pb2.Tensor
    old_logprobs: _common_pb2.Tensor
    ref_logprobs: _common_pb2.Tensor
    sampling_temperature: _common_pb2.Tensor
    sampling_top_k: _common_pb2.Tensor
    sampling_top_p: _common_pb2.Tensor
    sampler_kept_size: _common_pb2.Tensor
    sampler_kept_ids: _common_pb2.Tensor
    routed_experts: _common_pb2.Tensor
    def __init__(self, input_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., behaviour_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., weight_versions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ref_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampling_temperature: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampling_top_k: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampling_top_p: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampler_kept_size: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampler_kept_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., routed_experts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_name", "parameter_count", "trainable_parameter_count", "dtype", "device", "step", "weight_version", "ready", "lora_rank", "lora_target_modules", "model_ids")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    parameter_count: int
    trainable_parameter_count: int
    dtype: _common_pb2.DType
    device: str
    step: int
    weight_version: int
    ready: bool
    lora_rank: int
    lora_target_modules: _containers.RepeatedScalarFieldContainer[str]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., parameter_count: _Optional[int] = ..., trainable_parameter_count: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., device: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., ready: _Optional[bool] = ..., lora_rank: _Optional[int] = ..., lora_target_modules: _Optional[_Iterable[str]] = ..., model_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("batch", "loss", "expected_step", "forward_only")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STEP_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    batch: TrainBatch
    loss: LossSpec
    expected_step: int
    forward_only: bool
    def __init__(self, batch: _Optional[_Union[TrainBatch, _Mapping]] = ..., loss: _Optional[_Union[LossSpec, _Mapping]] = ..., expected_step: _Optional[int] = ..., forward_only: _Optional[bool] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("metrics", "loss_tokens", "logprobs")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    loss_tokens: int
    logprobs: _common_pb2.Tensor
    def __init__(self, metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., loss_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("expected_step", "adam")
    EXPECTED_STEP_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    expected_step: int
    adam: AdamStep
    def __init__(self, expected_step: _Optional[int] = ..., adam: _Optional[_Union[AdamStep, _Mapping]] = ...) -> None: ...

class AdamStep(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "weight_version", "grad_norm", "learning_rate")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    grad_norm: float
    learning_rate: float
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("batch", "loss", "micro_batch_size", "expected_step")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STEP_FIELD_NUMBER: _ClassVar[int]
    batch: TrainBatch
    loss: LossSpec
    micro_batch_size: int
    expected_step: int
    def __init__(self, batch: _Optional[_Union[TrainBatch, _Mapping]] = ..., loss: _Optional[_Union[LossSpec, _Mapping]] = ..., micro_batch_size: _Optional[int] = ..., expected_step: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("metrics", "step", "weight_version", "tokens")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    step: int
    weight_version: int
    tokens: int
    def __init__(self, metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("batch", "model", "micro_batch_size")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    batch: TrainBatch
    model: LogprobModel
    micro_batch_size: int
    def __init__(self, batch: _Optional[_Union[TrainBatch, _Mapping]] = ..., model: _Optional[_Union[LogprobModel, str]] = ..., micro_batch_size: _Optional[int] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    weight_version: int
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("directory", "remove_previous", "client_state")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    REMOVE_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    remove_previous: bool
    client_state: bytes
    def __init__(self, directory: _Optional[str] = ..., remove_previous: _Optional[bool] = ..., client_state: _Optional[bytes] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path", "latest")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    path: str
    latest: bool
    def __init__(self, path: _Optional[str] = ..., latest: _Optional[bool] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "weight_version", "client_state")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    weight_version: int
    client_state: bytes
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., client_state: _Optional[bytes] = ...) -> None: ...

class MemoryTarget(_message.Message):
    __slots__ = ("chunk_bytes", "bucket_bytes")
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_bytes: int
    bucket_bytes: int
    def __init__(self, chunk_bytes: _Optional[int] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class CheckpointTarget(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class NcclTarget(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ExportWeightsRequest(_message.Message):
    __slots__ = ("method", "memory", "checkpoint", "nccl", "merge_lora")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    MERGE_LORA_FIELD_NUMBER: _ClassVar[int]
    method: _common_pb2.SyncMethod
    memory: MemoryTarget
    checkpoint: CheckpointTarget
    nccl: NcclTarget
    merge_lora: bool
    def __init__(self, method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., memory: _Optional[_Union[MemoryTarget, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointTarget, _Mapping]] = ..., nccl: _Optional[_Union[NcclTarget, _Mapping]] = ..., merge_lora: _Optional[bool] = ...) -> None: ...

class ExportWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "bytes", "duration_seconds", "path", "identity")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    bytes: int
    duration_seconds: float
    path: str
    identity: bytes
    def __init__(self, weight_version: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., path: _Optional[str] = ..., identity: _Optional[bytes] = ...) -> None: ...

class SelectModelRequest(_message.Message):
    __slots__ = ("model_id", "lora_rank", "lora_modules")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    lora_rank: int
    lora_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class SelectModelResponse(_message.Message):
    __slots__ = ("created", "step")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    created: bool
    step: int
    def __init__(self, created: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class DropModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class DropModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
