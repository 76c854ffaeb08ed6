from flywheel.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text", "messages", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: TokenIds
    text: str
    messages: ChatMessages
    request_id: str
    def __init__(self, token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools_json: _Optional[_Iterable[str]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "run_step", "min_weight_version", "adapter")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: _common_pb2.SamplingParams
    run_step: int
    min_weight_version: int
    adapter: Adapter
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., run_step: _Optional[int] = ..., min_weight_version: _Optional[int] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("path", "identity")
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    path: str
    identity: bytes
    def __init__(self, path: _Optional[str] = ..., identity: _Optional[bytes] = ...) -> None: ...

class PromptResult(_message.Message):
    __slots__ = ("request_id", "samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    def __init__(self, request_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PromptResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PromptResult, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "run_step", "min_weight_version")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    sampling: _common_pb2.SamplingParams
    run_step: int
    min_weight_version: int
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., run_step: _Optional[int] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "text", "final")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    final: _common_pb2.Sample
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., final: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("model_name", "weight_version", "running_requests", "waiting_requests", "kv_cache_usage_ratio", "paused", "engine", "updating", "http_port", "max_model_len", "max_resident_adapters")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    UPDATING_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    weight_version: int
    running_requests: int
    waiting_requests: int
    kv_cache_usage_ratio: float
    paused: bool
    engine: str
    updating: bool
    http_port: int
    max_model_len: int
    max_resident_adapters: int
    def __init__(self, model_name: _Optional[str] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage_ratio: _Optional[float] = ..., paused: _Optional[bool] = ..., engine: _Optional[str] = ..., updating: _Optional[bool] = ..., http_port: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_resident_adapters: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.PauseMode
    def __init__(self, mode: _Optional[_Union[_common_pb2.PauseMode, str]] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("aborted_request_ids", "weight_version")
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    weight_version: int
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class MemorySource(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointSource(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class NcclSource(_message.Message):
    __slots__ = ("group_id", "rendezvous_address", "world_size", "rank", "backend")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rendezvous_address: str
    world_size: int
    rank: int
    backend: str
    def __init__(self, group_id: _Optional[str] = ..., rendezvous_address: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "method", "memory", "checkpoint", "nccl", "pause_mode", "timeout_seconds", "start_over")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    START_OVER_FIELD_NUMBER: _ClassVar[int]
    version: int
    method: _common_pb2.SyncMethod
    memory: MemorySource
    checkpoint: CheckpointSource
    nccl: NcclSource
    pause_mode: _common_pb2.PauseMode
    timeout_seconds: float
    start_over: bool
    def __init__(self, version: _Optional[int] = ..., method: _Optional[_Union[_common_pb2.SyncMethod, str]] = ..., memory: _Optional[_Union[MemorySource, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSource, _Mapping]] = ..., nccl: _Optional[_Union[NcclSource, _Mapping]] = ..., pause_mode: _Optional[_Union[_common_pb2.PauseMode, str]] = ..., timeout_seconds: _Optional[float] = ..., start_over: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "pause_seconds", "bytes", "aborted_request_ids")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    pause_seconds: float
    bytes: int
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, weight_version: _Optional[int] = ..., pause_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sequences", "top_logprobs", "min_weight_version")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenIds]
    top_logprobs: int
    min_weight_version: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., top_logprobs: _Optional[int] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class SequenceScore(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    weight_version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[SequenceScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[SequenceScore, _Mapping]]] = ...) -> None: ...
