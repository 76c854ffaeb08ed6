from flywheel.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_PHASE_UNSPECIFIED: _ClassVar[RunPhase]
    RUN_PHASE_IDLE: _ClassVar[RunPhase]
    RUN_PHASE_STARTING: _ClassVar[RunPhase]
    RUN_PHASE_RUNNING: _ClassVar[RunPhase]
    RUN_PHASE_STOPPING: _ClassVar[RunPhase]
    RUN_PHASE_COMPLETED: _ClassVar[RunPhase]
    RUN_PHASE_FAILED: _ClassVar[RunPhase]

class RunMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_MODE_UNSPECIFIED: _ClassVar[RunMode]
    RUN_MODE_SYNC: _ClassVar[RunMode]
    RUN_MODE_FULLY_ASYNC: _ClassVar[RunMode]
    RUN_MODE_BATCH_ASYNC: _ClassVar[RunMode]
RUN_PHASE_UNSPECIFIED: RunPhase
RUN_PHASE_IDLE: RunPhase
RUN_PHASE_STARTING: RunPhase
RUN_PHASE_RUNNING: RunPhase
RUN_PHASE_STOPPING: RunPhase
RUN_PHASE_COMPLETED: RunPhase
RUN_PHASE_FAILED: RunPhase
RUN_MODE_UNSPECIFIED: RunMode
RUN_MODE_SYNC: RunMode
RUN_MODE_FULLY_ASYNC: RunMode
RUN_MODE_BATCH_ASYNC: RunMode

class StartRequest(_message.Message):
    __slots__ = ("config_yaml", "run_id")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    run_id: str
    def __init__(self, config_yaml: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("run_id", "run_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_dir: str
    def __init__(self, run_id: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("checkpoint", "grace_seconds")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    grace_seconds: float
    def __init__(self, checkpoint: _Optional[bool] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("checkpoint_path",)
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    checkpoint_path: str
    def __init__(self, checkpoint_path: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunError(_message.Message):
    __slots__ = ("module", "severity", "message", "context", "unix_ms")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    module: str
    severity: str
    message: str
    context: str
    unix_ms: int
    def __init__(self, module: _Optional[str] = ..., severity: _Optional[str] = ..., message: _Optional[str] = ..., context: _Optional[str] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "phase", "mode", "step", "total_steps", "trainer_version", "metrics", "pool_size", "in_flight", "errors", "components", "message")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    phase: RunPhase
    mode: RunMode
    step: int
    total_steps: int
    trainer_version: int
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    pool_size: int
    in_flight: int
    errors: _containers.RepeatedCompositeFieldContainer[RunError]
    components: _containers.RepeatedCompositeFieldContainer[_common_pb2.ComponentStatus]
    message: str
    def __init__(self, run_id: _Optional[str] = ..., phase: _Optional[_Union[RunPhase, str]] = ..., mode: _Optional[_Union[RunMode, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., trainer_version: _Optional[int] = ..., metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., pool_size: _Optional[int] = ..., in_flight: _Optional[int] = ..., errors: _Optional[_Iterable[_Union[RunError, _Mapping]]] = ..., components: _Optional[_Iterable[_Union[_common_pb2.ComponentStatus, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("after_step",)
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    def __init__(self, after_step: _Optional[int] = ...) -> None: ...

class StreamMetricsResponse(_message.Message):
    __slots__ = ("step", "metrics", "unix_ms")
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    unix_ms: int
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., unix_ms: _Optional[int] = ...) -> None: ...
