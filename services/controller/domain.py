"""Domain types of the controller: tasks, generations, trajectories, rollout
outcomes and the results of remote calls.

Everything here is plain data (no grpc, no torch) so that workers, rewards,
stores and algorithms can be written and tested without any service running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Shared words (defined in flywheel.common.types); the controller's modules import them from here too.
from flywheel.common.kept import KeptSet
from flywheel.common.provenance import VersionSpan
from flywheel.common.types import RAW, FinishReason, SampledDistribution, SamplingSpec  # noqa: F401

#: A chat message as an OpenAI-style dict: {"role": ..., "content": ..., ...}.
Message = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """One row of a dataset, as handed to a rollout worker."""

    #: Unique within the run: "<split>:<epoch>:<index>".
    id: str
    #: Row index in the dataset (stable across epochs and resumes).
    index: int
    #: Epoch the task was drawn in, from 0.
    epoch: int
    #: Text, or a list of chat messages.
    prompt: str | list[Message]
    #: Reference answer, when the dataset has one (math, QA).
    answer: Any = None
    #: The whole row, for rewards and tools that need more fields.
    data: Mapping[str, Any] = field(default_factory=dict)
    split: str = "train"


@dataclass(frozen=True)
class PromptInput:
    """What an engine generates from: exactly one of text, messages, token_ids."""

    request_id: str
    text: str | None = None
    messages: list[Message] | None = None
    token_ids: list[int] | None = None
    #: OpenAI-style tool definitions passed to the chat template.
    tools: list[dict[str, Any]] | None = None


@dataclass
class Generation:
    """One completion returned by a rollout engine: tokens, log-probs, versions."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    #: Log-prob of each completion token under the policy that sampled it.
    completion_logprobs: list[float]
    finish_reason: FinishReason
    #: Weight version when generation started / ended (differ when the
    #: engine moved to new weights mid-generation).
    version_start: int
    version_end: int
    text: str = ""
    #: Which replica produced it.
    engine: str = ""
    #: The distribution `completion_logprobs` are of (the sampling contract).
    distribution: SampledDistribution = RAW
    #: The version that produced each completion token, as spans over `completion_token_ids`
    #: (flywheel.common.provenance); empty when the engine could not tell.
    version_spans: list[VersionSpan] = field(default_factory=list)
    #: The sampler's kept set where a cut or a grammar applied, per completion position (flywheel.common.kept).
    kept_sets: list[KeptSet] = field(default_factory=list)
    #: Mixture-of-experts routing of every token fed to the model (prompt, then completion but its last),
    #: a numpy int array [P + C - 1, L, K] (flywheel.models.moe's compact dtypes); None: not recorded.
    routed_experts: Any = None


class TrajectoryStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"


@dataclass
class Trajectory:
    """A scored, token-level episode: what the algorithm and the trainer see."""

    task: Task
    prompt_ids: list[int]
    response_ids: list[int]
    #: Behaviour log-prob per response token (0 where response_mask is 0).
    response_logprobs: list[float]
    #: 1 where the policy produced the token (trained on), 0 for tool or
    #: environment tokens (excluded from the loss).
    response_mask: list[int]
    version_start: int
    version_end: int
    finish_reason: FinishReason = FinishReason.STOP
    #: (version_start, version_end) of each model call of a multi-turn episode,
    #: in order; empty for single-turn samples.
    turn_versions: list[tuple[int, int]] = field(default_factory=list)
    reward: float = 0.0
    #: Named scores (e.g. "accuracy", "format"); `reward` is also recorded here.
    scores: dict[str, float] = field(default_factory=dict)
    text: str = ""
    #: Index among the samples of its task, from 0.
    sample_index: int = 0
    #: Which model trains on it (the trajectory pool keeps one store per tag).
    model_tag: str = "default"
    #: Extra grouping keys for hierarchical stores (e.g. {"turn": 2}).
    keys: dict[str, Any] = field(default_factory=dict)
    #: The rollout replica that generated it (its last turn, for multi-turn episodes).
    engine: str = ""
    #: The distribution its model tokens were drawn from, which their log-probs are of; the
    #: trainer takes its log-probs under the same (TrainBatch sampling_*).
    distribution: SampledDistribution = RAW
    status: TrajectoryStatus = TrajectoryStatus.OK
    error: str | None = None
    #: Set by the algorithm processor.
    advantage: float | None = None
    #: On-policy distillation (algorithm.teacher): the teacher's log-prob of each response token (0 where
    #: response_mask is 0), set once the group is generated (services/controller/tasks/teacher.py).
    teacher_logprobs: list[float] | None = None
    #: Per response token, the advantage the trainer weighs it by, where one sequence-wide `advantage`
    #: does not say it (distillation: `batches.algorithms.distilled`); None: `advantage` for every token.
    token_advantages: list[float] | None = None
    #: The version that produced each model token, as spans over `response_ids` in order; tool and
    #: environment tokens fall between them. Tokens no span covers (an engine or an older rollout that
    #: could not tell) are attributed to `version`, the oldest policy that contributed.
    version_spans: list[VersionSpan] = field(default_factory=list)
    #: The sampler's kept set per response position where one was recorded (flywheel.common.kept).
    kept_sets: list[KeptSet] = field(default_factory=list)
    #: Mixture-of-experts routing per position of prompt + response (numpy int [N, L, K], N <= num_tokens;
    #: flywheel.models.moe's compact dtypes); None: not recorded (a dense model, or an engine that cannot).
    routed_experts: Any = None

    @property
    def version(self) -> int:
        """The version staleness is measured from: the oldest policy that contributed."""
        return min([self.version_start, *(start for start, _ in self.turn_versions)])

    def token_versions(self) -> list[int]:
        """The version of each response token (`version_spans`; `version` where none covers it)."""
        out = [self.version] * len(self.response_ids)
        for span in self.version_spans:
            if not 0 <= span.start < span.end <= len(out):
                raise ValueError(f"trajectory of task {self.task.id}: version span {tuple(span)} lies outside its "
                                 f"{len(out)} response tokens")
            out[span.start:span.end] = [span.version] * (span.end - span.start)
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def key(self, name: str) -> Any:
        """Value of a grouping key: "task" (the task id), a `keys` entry or a task field."""
        if name in ("task", "task_id", "prompt_id"):
            return self.task.id
        if name in self.keys:
            return self.keys[name]
        if name in self.task.data:
            return self.task.data[name]
        raise KeyError(f"trajectory has no grouping key {name!r}")


class RolloutStatus(str, Enum):
    SUCCESS = "success"
    #: Give up on this task (recorded as an error; the task is not retried).
    FAIL = "fail"
    #: Put the task back at the front of the loader and try again later.
    RE_ROLLOUT = "re-rollout"


@dataclass
class RolloutOutcome:
    status: RolloutStatus
    trajectories: list[Trajectory] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class TrainResult:
    """What one TrainStep returned."""

    step: int
    version: int
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerState:
    step: int
    version: int


@dataclass(frozen=True)
class RestoredCheckpoint:
    path: str
    step: int
    version: int
    client_state: bytes


#: The run step (train batch, from 1) that generations requested in this
#: context are for; set per rollout by the rollout manager, sent with every
#: Generate so each replica counts its own steps (0: not part of a step).
RUN_STEP: ContextVar[int] = ContextVar("run_step", default=0)
#: The least weight version generations requested in this context must be
#: made with (validation names the version it measures; 0: any).
MIN_WEIGHT_VERSION: ContextVar[int] = ContextVar("min_weight_version", default=0)
#: Frees the generation slot of the rollout running in this context (set per rollout by the rollout
#: manager; None elsewhere): a worker calls it once its generation is done and only scoring is left
#: (`RolloutWorker.score_all`), so that the next task generates while a remote judge scores this one.
GENERATION_DONE: ContextVar[Callable[[], None] | None] = ContextVar("generation_done", default=None)
