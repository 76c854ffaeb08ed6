"""The configuration of one run, from one YAML file.

    run: {name: gsm8k-grpo, seed: 1, max_steps: 200}
    services:
      trainer: {address: 127.0.0.1:50052}
      synchronizer: {address: 127.0.0.1:50051}
    data:
      train: {path: data/train.jsonl, prompt_key: question, answer_key: answer}
      validation: {path: data/test.jsonl, prompt_key: question, answer_key: answer, shuffle: false}
    worker: {type: math, group_size: 8, sampling: {temperature: 1.0, max_tokens: 512}}
    reward: {name: math}
    algorithm: {name: dapo, train_batch_size: 64}
    mode: batch-async
    staleness: {threshold: 1}
    sync: {method: memory, interval: 1}
    validation: {interval: 10, before_training: true}
    checkpoint: {interval: 50}
    resume: {from: latest}

Every section is a `StrictModel`: a misspelt field or a bad value is a
`ConfigError` whose message names the field (`worker.group_sise: unknown
field`). Cross-field rules (batch divisible by group size, a validation set
when validation is on...) are checked here too, so a run fails before it
starts rather than halfway through. Only pydantic is imported: the service's
`--help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from flywheel.runtime.config import ConfigError, StrictModel, read_config_file
from flywheel.trainer.types import default_clip_high
# The sections, one module a group (what other modules import from here too).
from services.controller.run_config.algorithm import (
    DEFAULT_IS_CAP, AlgorithmConfig, JudgeConfig, LossConfig, OverlongConfig, RewardConfig, TeacherConfig,
)
from services.controller.run_config.pacing import PoolConfig, StalenessConfig, SyncConfig
from services.controller.run_config.records import (
    CheckpointConfig, ErrorsConfig, MetricsConfig, ResumeConfig, RunSection, ValidationConfig,
)
from services.controller.run_config.sources import (
    DataConfig, LoaderConfig, ModelConfig, ServiceEndpoint, ServicesConfig,
)
from services.controller.run_config.worker import (
    EnvironmentConfig, SamplingConfig, ToolConfig, VerifiersConfig, WorkerConfig,
)

Mode = Literal["sync", "fully-async", "batch-async"]


class RunConfig(StrictModel):
    run: RunSection = Field(default_factory=RunSection, description="the run")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy")
    services: ServicesConfig = Field(default_factory=ServicesConfig, description="where the services are")
    data: DataConfig = Field(description="datasets")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="rollout workers")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward function")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantages and batches")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="trajectory pool")
    mode: Mode = Field("sync", description="sync | fully-async | batch-async")
    staleness: StalenessConfig = Field(default_factory=StalenessConfig, description="off-policy bound")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="weight synchronisation")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="validation")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    resume: ResumeConfig = Field(default_factory=ResumeConfig, description="resuming")
    errors: ErrorsConfig = Field(default_factory=ErrorsConfig, description="error policy")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="metric sinks")

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        b, g = self.algorithm.train_batch_size, self.worker.group_size
        if b % g:
            raise ValueError(f"algorithm.train_batch_size ({b}) must be a multiple of worker.group_size ({g})")
        if (self.validation.interval or self.validation.before_training) and self.data.validation is None:
            raise ValueError("validation.interval / validation.before_training need data.validation")
        if self.pool_store == "hierarchical" and len(self.pool.keys) < 2:
            raise ValueError("pool.keys: a hierarchical store needs at least two keys")
        if self.buffer_size_limit < b:
            raise ValueError(f"pool.buffer_size_limit ({self.buffer_size_limit}) must be >= algorithm.train_batch_size ({b})")
        self._check_schedule()
        if self.algorithm.teacher is not None and self.dynamic_sampling:
            raise ValueError("algorithm.teacher: dynamic sampling drops groups whose rewards are all equal, and under "
                             "distillation they still teach (the teacher's log-probs); set algorithm.dynamic_sampling "
                             "false")
        if self.worker.type == "openenv" and self.worker.env is None:
            raise ValueError("worker.env: the openenv worker needs its environment server (worker.env.url)")
        if self.worker.env is not None and ":" not in self.worker.type and self.worker.type != "openenv":
            # (A worker of your own, 'module:Class', may be an EnvironmentWorker: the assembly checks that.)
            raise ValueError(f"worker.env: only the openenv worker plays an environment server (worker.type is "
                             f"{self.worker.type!r})")
        if self.worker.env is not None and (self.worker.instruction or not self.worker.chat
                                            or self.worker.tools or self.worker.tool_result_template):
            raise ValueError("worker: the openenv worker shows the model the environment's observations as chat "
                             "messages; instruction, chat false, tools and tool_result_template are not used by it")
        if self.worker.env is not None and "reward" in self.model_fields_set:
            raise ValueError("reward: the openenv worker trains on the environment's reward; leave reward out")
        if self.worker.env is not None and not self.worker.env.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"worker.env.url: must be an http(s) or ws(s) URL, got {self.worker.env.url!r}")
        self._check_verifiers()
        if self.worker.type == "agent" and not self.worker.tools:
            raise ValueError("worker.tools: the agent worker needs at least one tool")
        self._check_external_agent()
        return self

    def _check_verifiers(self) -> None:
        w = self.worker
        if w.type == "verifiers" and w.verifiers is None:
            raise ValueError("worker.verifiers: the verifiers worker needs its environment (worker.verifiers)")
        if w.verifiers is not None and ":" not in w.type and w.type != "verifiers":
            # (A worker of your own, 'module:Class', may be a VerifiersWorker: the assembly checks that.)
            raise ValueError(f"worker.verifiers: only the verifiers worker plays a verifiers environment (worker.type "
                             f"is {w.type!r})")
        if w.verifiers is None:
            return
        if not w.verifiers.taskset and not w.verifiers.url:
            raise ValueError("worker.verifiers: name the taskset the controller's host plays (taskset), or the url "
                             "of a host you run")
        if w.verifiers.url and not w.verifiers.url.startswith(("http://", "https://")):
            raise ValueError(f"worker.verifiers.url: must be an http(s) URL, got {w.verifiers.url!r}")
        if w.instruction or not w.chat or w.system_prompt or w.tools or w.tool_result_template or w.agent:
            raise ValueError("worker: the verifiers worker's prompts, system prompt and tools are the taskset's; "
                             "instruction, chat false, system_prompt, tools, tool_result_template and agent are "
                             "not used by it")
        if "reward" in self.model_fields_set:
            raise ValueError("reward: the verifiers worker trains on the environment's reward; leave reward out")
        if w.agent_timeout_seconds >= w.timeout_seconds:
            raise ValueError(f"worker.agent_timeout_seconds ({w.agent_timeout_seconds:g}), the limit of one episode, "
                             f"must be below worker.timeout_seconds ({w.timeout_seconds:g})")

    def _check_external_agent(self) -> None:
        w = self.worker
        if w.type in ("simple", "math", "agent") and w.agent is not None:
            raise ValueError(f"worker.agent: only the external worker runs an agent (worker.type is {w.type!r})")
        if w.type != "external":
            return
        if not w.agent:
            raise ValueError(
                "worker.agent: the external worker needs your agent: 'package.module:function', "
                "'path/to/file.py:function' or an http(s) URL of your agent service"
            )
        if not w.agent.startswith(("http://", "https://")) and ":" not in w.agent:
            raise ValueError(
                f"worker.agent: {w.agent!r} is neither 'package.module:function', 'path/to/file.py:function' "
                "nor an http(s) URL"
            )
        if w.agent_timeout_seconds >= w.timeout_seconds:
            raise ValueError(
                f"worker.agent_timeout_seconds ({w.agent_timeout_seconds:g}) must be below worker.timeout_seconds "
                f"({w.timeout_seconds:g}): the rollout's limit would cut episodes before their own"
            )
        if w.session_ttl_seconds is not None and w.session_ttl_seconds <= w.agent_timeout_seconds:
            raise ValueError(
                f"worker.session_ttl_seconds ({w.session_ttl_seconds:g}) must exceed worker.agent_timeout_seconds "
                f"({w.agent_timeout_seconds:g}): the session's records must outlive the episode"
            )

    def _check_schedule(self) -> None:
        """Which sync schedules each mode can keep (docs/architecture.md, "Who moves the weights")."""
        s = self.sync
        if self.mode == "sync" and s.style != "fixed":
            raise ValueError("sync.style: sync mode needs a fixed schedule (every sample on the due version)")
        if self.mode != "batch-async":
            return
        lookahead = self.staleness.lookahead
        if lookahead is not None and lookahead > self.staleness.threshold:
            raise ValueError(
                f"staleness.lookahead ({lookahead}) must be <= staleness.threshold ({self.staleness.threshold})"
            )
        lag, why = self._schedule_lag
        name, bound = ("staleness.lookahead", lookahead) if lookahead is not None else (
            "staleness.threshold", self.staleness.threshold)
        if bound < lag:
            raise ValueError(
                f"{name} ({bound}) must be >= {why} ({lag}): rollouts cannot be fresher than the schedule moves "
                "their weights"
            )

    @property
    def _schedule_lag(self) -> tuple[int, str]:
        """How many versions behind the trainer the sync schedule may leave a replica, and why."""
        s = self.sync
        if s.style == "fixed":
            return s.offset + s.interval - 1, "sync.offset + sync.interval - 1"
        return s.interval + 1, "sync.interval + 1"

    # Resolved defaults, so every component reads the same value.
    @property
    def pool_store(self) -> str:
        return self.pool.store or ("grouped" if self.worker.group_size > 1 else "simple")

    @property
    def buffer_size_limit(self) -> int:
        return self.pool.buffer_size_limit or 2 * self.algorithm.train_batch_size

    @property
    def dynamic_sampling(self) -> bool:
        if self.algorithm.dynamic_sampling is not None:
            return self.algorithm.dynamic_sampling
        return self.algorithm.name == "dapo"

    @property
    def loss(self) -> LossConfig:
        """The loss sent with every TrainStep, defaults resolved."""
        loss = self.algorithm.loss
        kind = loss.kind or ("dapo" if self.algorithm.name == "dapo" else "grpo")
        clip_high = loss.clip_high if loss.clip_high is not None else default_clip_high(kind, loss.clip_low)
        is_cap = DEFAULT_IS_CAP if loss.is_cap is None else loss.is_cap
        return loss.model_copy(update={"kind": kind, "clip_high": clip_high, "is_cap": is_cap})

    @property
    def verify_timeout_seconds(self) -> float:
        """How long a train step waits for a replica's proof of its batch's versions (sync.verify_timeout_seconds)."""
        return self.sync.verify_timeout_seconds or self.sync.timeout_seconds

    @property
    def staleness_limit(self) -> int | None:
        """The enforced bound on trained samples, or None when they may be arbitrarily stale.
        Sync mode: the schedule's own lag (0 for FIXED(1, 0): on-policy)."""
        if self.mode == "sync":
            return self.sync.offset + self.sync.interval - 1
        if self.mode == "batch-async":
            return self.staleness.threshold
        return None

    @property
    def token_staleness_bound(self) -> int:
        """The most versions a trained token may lag the batch it is trained in, in every mode: sync the
        schedule's lag, batch-async staleness.threshold, fully-async staleness.fully_async_bound."""
        limit = self.staleness_limit
        return self.staleness.fully_async_bound if limit is None else limit

    @property
    def corrects_stale_tokens(self) -> bool:
        """Whether tokens past `token_staleness_bound` are trained with the IS correction (policy correct with a
        cap in force) rather than masked out of the loss."""
        return self.staleness.policy == "correct" and self.loss.is_cap > 0

    @property
    def dispatch_lookahead(self) -> int | None:
        """How many batches past the trainer's version rollouts may be started for (the
        staleness gate's limit, and how far a replica may lag): sync mode none (lockstep),
        batch-async staleness.lookahead (its default: see below), fully-async none."""
        if self.mode == "sync":
            return 0
        if self.mode == "batch-async" and self.staleness.lookahead is not None:
            return self.staleness.lookahead
        threshold = self.staleness.threshold
        if self.mode == "batch-async" and self.staleness.policy == "pace" and threshold >= 2:
            # Pacing's default slack: rollouts start one version less far ahead than the bound, so a long
            # group may finish a version late before the trainer waits for it (docs/architecture.md, "Versions
            # and staleness": on a long-tailed mix it idles as drop does, where with no slack it idled twice as
            # much), while samples stay about as fresh as with threshold - 1.
            return max(threshold - 1, self._schedule_lag[0])
        return self.staleness_limit

    @property
    def pace_slack(self) -> int:
        """Versions a group in flight may still slip past the batch it was planned into and
        stay within the bound: its replica serves weights at most dispatch_lookahead behind that
        batch (batch-async), or the schedule's due version (sync: no slack)."""
        if self.mode == "batch-async":
            return self.staleness.threshold - (self.dispatch_lookahead or 0)
        return 0


def _format(exc: ValidationError, origin: str) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "value_error") else f" (got {err.get('input')!r})"
        lines.append(f"{path + ': ' if path else ''}{msg}{got}")
    return f"invalid run configuration ({origin}):\n  " + "\n  ".join(lines)


def parse_run_config(data: dict[str, Any], origin: str = "input") -> RunConfig:
    """Validates a run configuration; ConfigError names every bad field."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, origin)) from None


def load_run_config(path: Path) -> RunConfig:
    """Reads and validates a YAML/JSON run file."""
    return parse_run_config(read_config_file(Path(path)), f"file {path}")


def run_config_from_yaml(text: str) -> RunConfig:
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"run configuration: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("run configuration: the top level must be a mapping")
    return parse_run_config(data, "request")


__all__ = [
    "Mode",
    "RunConfig",
    "load_run_config",
    "parse_run_config",
    "run_config_from_yaml",
    "ServiceEndpoint",
    "ServicesConfig",
    "ModelConfig",
    "LoaderConfig",
    "DataConfig",
    "SamplingConfig",
    "ToolConfig",
    "EnvironmentConfig",
    "VerifiersConfig",
    "WorkerConfig",
    "JudgeConfig",
    "RewardConfig",
    "OverlongConfig",
    "LossConfig",
    "TeacherConfig",
    "AlgorithmConfig",
    "PoolConfig",
    "StalenessConfig",
    "SyncConfig",
    "ValidationConfig",
    "CheckpointConfig",
    "ResumeConfig",
    "ErrorsConfig",
    "MetricsConfig",
    "RunSection",
]
