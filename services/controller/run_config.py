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

from flywheel.common.types import PauseMode
from flywheel.synchronizer.types import SyncMethodName, SyncStyleName
from flywheel.trainer.types import DAPO_CLIP_HIGH, Aggregation, ClippedLossKind, default_clip_high
from flywheel.runtime.config import ConfigError, StrictModel, read_config_file

Mode = Literal["sync", "fully-async", "batch-async"]


class ServiceEndpoint(StrictModel):
    address: str = Field(description="gRPC address host:port")
    id: str = Field(
        "", description="the component id the service registers with at the synchronizer (a rollout's "
        "synchronizer.component_id): the name of a rollout replica in NCCL groups and logs; default: its address"
    )
    timeout_seconds: float = Field(30.0, gt=0, description="default deadline of a call, in seconds")


class ServicesConfig(StrictModel):
    trainer: ServiceEndpoint = Field(
        default_factory=lambda: ServiceEndpoint(address="127.0.0.1:50052", timeout_seconds=600.0),
        description="the trainer service",
    )
    rollout: list[ServiceEndpoint] = Field(
        default_factory=list,
        description="a filter on the rollout replicas registered with the synchronizer (by id or address); "
        "empty: every registered rollout. Requests are balanced over the healthy ones",
    )
    rollout_timeout_seconds: float = Field(
        900.0, gt=0, description="deadline of a call to a rollout replica found in the synchronizer's registry and "
        "not listed in services.rollout (a generation, including its wait for the weights its step needs), in seconds"
    )
    wait_for_rollout_seconds: float = Field(
        600.0, gt=0, description="how long the run waits for a rollout replica to serve, at start (with a "
        "synchronizer: to register and serve) and whenever every replica is down, in seconds; then it stops"
    )
    synchronizer: ServiceEndpoint = Field(
        default_factory=lambda: ServiceEndpoint(address="127.0.0.1:50051"),
        description="the synchronizer: every run has one (it owns the weight versions and the sync policy; the "
        "trainer publishes to it and the replicas follow it; the local launcher starts one)",
    )
    trainer_id: str = Field("trainer-0", description="component id of the trainer at the synchronizer")
    health_interval_seconds: float = Field(5.0, gt=0, description="period of gRPC health checks, in seconds")
    auth_token_file: Path | None = Field(None, description="bearer token file; falls back to env FLYWHEEL_AUTH_TOKEN")


class ModelConfig(StrictModel):
    name: str = Field("", description="model name or path (informational; the services load it)")
    tag: str = Field("default", description="model tag trajectories are pooled under")


class LoaderConfig(StrictModel):
    format: Literal["jsonl", "parquet", "list", "hf"] | None = Field(
        None, description="source format; inferred from path's suffix, or 'list' with items"
    )
    path: Path | None = Field(None, description="JSONL or Parquet file")
    items: list[dict[str, Any]] | None = Field(None, description="rows given inline")
    hf_name: str | None = Field(None, description="a Hugging Face dataset name (needs `datasets`)")
    hf_split: str = Field("train", description="split of hf_name")
    prompt_key: str = Field("prompt", description="row field holding the prompt (text or chat messages)")
    answer_key: str | None = Field("answer", description="row field holding the reference answer")
    shuffle: bool = Field(True, description="shuffle each epoch (seeded by run.seed + epoch)")
    limit: int | None = Field(None, ge=1, description="use only the first N rows")

    @model_validator(mode="after")
    def _one_source(self) -> LoaderConfig:
        given = [name for name in ("path", "items", "hf_name") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of path, items, hf_name must be set (got {given or 'none'})")
        return self


class DataConfig(StrictModel):
    train: LoaderConfig = Field(description="training tasks")
    validation: LoaderConfig | None = Field(None, description="validation tasks (read in order, once per validation)")
    epochs: int = Field(1, ge=1, description="passes over the training data")
    drop_last: bool = Field(True, description="drop a final batch smaller than algorithm.train_batch_size")


class SamplingConfig(StrictModel):
    temperature: float = Field(1.0, ge=0, description="softmax temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass")
    top_k: int = Field(-1, description="top-k cut-off; -1 disables")
    max_tokens: int = Field(256, ge=1, description="completion length limit, in tokens")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    seed: int | None = Field(None, description="sampling seed")


class ToolConfig(StrictModel):
    name: str = Field(description="name the model calls the tool by")
    function: str = Field(description="'module:attr' of a sync or async Python function")
    description: str = Field("", description="shown to the model")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="JSON schema of the arguments"
    )


class EnvironmentConfig(StrictModel):
    """An OpenEnv environment server (worker.type openenv, services/controller/workers/environment.py):
    one session an episode over its WebSocket path (/ws): reset, then a step per model turn, the
    model's text as the action, until the environment says done."""

    url: str = Field(description="http(s):// (or ws(s)://) root of the environment server; its sessions are at /ws")
    prompt_field: str = Field(
        "prompt", description="the observation's field shown to the model: the first user message after reset, "
        "and each later observation as the next user turn"
    )
    action_field: str = Field("message", description="the action's field the model's reply goes into")
    reset_fields: list[str] = Field(
        default_factory=list, description="fields of the task's row passed to reset, besides seed (the row's "
        "`seed`, else one drawn from its split and index: every episode of a group gets the same) and episode_id"
    )
    observation_template: str = Field(
        "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n",
        description="text a later observation is rendered as, with {observation} (ChatML's user turn by default); "
        "never trained"
    )
    timeout_seconds: float = Field(60.0, gt=0, description="deadline of one reset or step, in seconds")
    connect_timeout_seconds: float = Field(10.0, gt=0, description="deadline of opening a session, in seconds")
    max_concurrency: int = Field(64, ge=1, description="sessions open at once")


class VerifiersConfig(StrictModel):
    """A verifiers environment (worker.type verifiers, services/controller/workers/verifiers.py): its
    episodes are played by the verifiers host (services/controller/adapters/verifiers_host.py), which the
    controller starts in verifiers' own virtual environment unless `url` names one you run."""

    taskset: str | None = Field(
        None, description="id of the verifiers taskset (an installed package, or one in `path`) the host plays; "
        "each task is the run's data row validated into its TaskData (the row's `prompt`, else data's prompt_key)"
    )
    taskset_args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    harness: str = Field("null", description="the verifiers harness the model runs in (null: verifiers' plain chat "
                         "loop, which needs no container); the runtime is verifiers' subprocess runtime")
    path: list[str] = Field(default_factory=list, description="directories put on the host's import path (a "
                            "taskset package that is not installed)")
    url: str | None = Field(None, description="http(s) URL of a verifiers host you started yourself; then the "
                            "controller starts none (taskset, when given, must be the one it serves)")
    python: str | None = Field(
        None, description="interpreter of the virtual environment verifiers is installed in; default: "
        ".venv-verifiers beside the controller's (.venv), which make setup makes"
    )
    max_concurrency: int = Field(32, ge=1, description="episodes the host plays at once")
    startup_timeout_seconds: float = Field(120.0, gt=0, description="how long the host may take to serve")


class WorkerConfig(StrictModel):
    type: str = Field(
        "simple", description="simple | math | agent | external (your own openai-SDK agent, see worker.agent) | "
        "openenv (an OpenEnv environment server, see worker.env) | verifiers (a verifiers environment, see "
        "worker.verifiers) | 'module:Class' of your own worker"
    )
    group_size: int = Field(4, ge=1, description="completions per task (the GRPO group)")
    max_in_flight: int = Field(32, ge=1, description="tasks rolled out concurrently")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling of training rollouts")
    chat: bool = Field(True, description="send text prompts as a user chat message (chat template applied)")
    system_prompt: str | None = Field(None, description="system message prepended to chat prompts")
    instruction: str | None = Field(
        None,
        description="math: text appended to every question; default the worker's own (asks for step-by-step "
        "reasoning and a \\boxed{} answer), '' for none",
    )
    max_turns: int = Field(4, ge=1, description="agent, openenv: assistant turns per episode")
    env: EnvironmentConfig | None = Field(None, description="openenv: the environment server the episodes run in")
    verifiers: VerifiersConfig | None = Field(None, description="verifiers: the verifiers environment the episodes "
                                              "are played in")
    tools: list[ToolConfig] = Field(default_factory=list, description="agent: tools the model may call")
    tool_result_template: str | None = Field(
        None, description="agent: text a tool result is rendered as, with {result}; default ChatML tool turn"
    )
    tool_timeout_seconds: float = Field(60.0, gt=0, description="agent: limit of one tool call, in seconds")
    agent: str | None = Field(
        None, description="external: the agent, 'package.module:function' or 'path/to/file.py:function' called as "
        "function(task, base_url, api_key) (async, or sync run in a thread; returns the reward or None), or the "
        "http(s) URL of your agent service, POSTed {task, base_url, api_key, session_id} and answering {reward}"
    )
    agent_timeout_seconds: float = Field(
        300.0, gt=0, description="external, verifiers: limit of one episode, in seconds (past it the task is retried)"
    )
    session_ttl_seconds: float | None = Field(
        None, gt=0, description="external, verifiers: how long a replica keeps an episode's session and its "
        "records, in seconds; default agent_timeout_seconds + 60"
    )
    max_retries: int = Field(3, ge=0, description="re-rollouts of one task before it is recorded as failed")
    timeout_seconds: float = Field(600.0, gt=0, description="limit of one rollout step, in seconds")


class JudgeConfig(StrictModel):
    """A remote judge: the reward is what an HTTP scoring service answers for each completion
    (services/controller/tasks/judge.py; the bodies in docs/remote-judge.md)."""

    url: str = Field(description="http(s) URL the judgement is POSTed to")
    format: Literal["flywheel", "slime", "nemo_gym"] = Field(
        "flywheel", description="the body sent and the answer read: flywheel ({prompt, completion, metadata} -> "
        "{reward, scores}), slime (remote_rm: {prompt, response, label} -> a number) or nemo_gym (/verify: "
        "{responses_create_params, response, row fields} -> {reward}, mask_sample a failure)"
    )
    timeout_seconds: float = Field(30.0, gt=0, description="deadline of one call, in seconds; past it the call failed")
    max_attempts: int = Field(3, ge=1, description="calls per judgement, the first included (a failed or late call is "
                              "retried after retry_backoff_seconds, doubling)")
    retry_backoff_seconds: float = Field(0.5, ge=0, description="wait before the first retry, in seconds")
    max_concurrency: int = Field(64, ge=1, description="calls in flight at once (connections to the judge)")
    max_consecutive_failures: int = Field(
        20, ge=1, description="judgements in a row that failed (after their retries) before the run is told, as a "
        "critical error: errors.policy then decides (stop_on_critical, the default, and stop_on_error stop the run; "
        "continue records it). A failed judgement fails its trajectory, whose group is given up and counted "
        "(rollout/failed_trajectories_total, judge/failed_total); it is never trained as a reward of 0"
    )
    groups_in_flight: int | None = Field(
        None, ge=0, description="groups being judged while generation goes on (rollout slots beyond "
        "worker.max_in_flight, which stays the number of tasks generating); default as many as max_concurrency "
        "calls can judge at once (max_concurrency / worker.group_size, at least 1). Too few and generation waits "
        "for scores: keep it above worker.max_in_flight x (a judgement's time, retries included) / (a group's "
        "generation time). 0 judges inside the generation slot: generation waits for every score"
    )


class RewardConfig(StrictModel):
    name: str = Field("math", description="registered reward name or 'module:function'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments of the reward")
    judge: JudgeConfig | None = Field(None, description="a remote judge instead of a reward function (not with name)")

    @model_validator(mode="after")
    def _one_reward(self) -> RewardConfig:
        if self.judge is not None and {"name", "kwargs"} & self.model_fields_set:
            raise ValueError("give reward.name (and kwargs) or reward.judge, not both")
        if self.judge is not None and not self.judge.url.startswith(("http://", "https://")):
            raise ValueError(f"judge.url: must be an http(s) URL, got {self.judge.url!r}")
        return self


class OverlongConfig(StrictModel):
    filter: bool = Field(False, description="exclude truncated completions from the loss (DAPO overlong filtering)")
    penalty: bool = Field(False, description="add DAPO's soft overlong punishment to the reward")
    max_length: int | None = Field(None, ge=1, description="length limit, in tokens; default worker.sampling.max_tokens")
    buffer_length: int = Field(64, ge=1, description="punishment ramp length before max_length, in tokens")
    penalty_factor: float = Field(1.0, ge=0, description="scale of the punishment (reaches -factor at max_length)")


class LossConfig(StrictModel):
    # Tinker's unclipped losses are for callers that compute their own advantages or weights per call.
    kind: ClippedLossKind | None = Field(None, description="loss; default follows algorithm.name")
    clip_low: float = Field(0.2, ge=0, description="lower clip epsilon")
    clip_high: float | None = Field(None, ge=0, description=f"upper clip epsilon; default {DAPO_CLIP_HIGH} for dapo, else clip_low")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference weight")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight")
    aggregation: Aggregation | None = Field(
        None, description="per-token loss aggregation; default the trainer's. seq_mean_token_sum_norm is Dr. "
        "GRPO's: token sums over (sequences x worker.sampling.max_tokens). Sequences with no loss token count in "
        "no denominator"
    )
    is_cap: float = Field(0.0, ge=0, description="truncated importance-sampling cap; 0 disables (staleness.policy=correct sets 2)")


class TeacherConfig(StrictModel):
    """On-policy distillation: a teacher model scores the tokens the student sampled, and each token's
    advantage is kl_coef x (the teacher's log-prob - the student's sampling log-prob), the per-token
    reverse KL's negative, plus reward_coef x the group advantage of the task reward
    (services/controller/tasks/teacher.py)."""

    addresses: list[str] = Field(
        min_length=1, description="gRPC host:port of rollout replicas serving the teacher model, started without "
        "synchronizer.address (registered with the run's synchronizer they would be sampled from as the student); "
        "their Score RPC is called, a group at a time, each call on the next address"
    )
    kl_coef: float = Field(1.0, gt=0, description="weight of the per-token reverse KL to the teacher in the advantage")
    reward_coef: float = Field(
        0.0, ge=0, description="weight of the task reward's group advantage (the algorithm's) added to every token; "
        "0: distillation alone (the reward is still computed and recorded)"
    )
    timeout_seconds: float = Field(60.0, gt=0, description="deadline of one Score call, in seconds")
    max_attempts: int = Field(3, ge=1, description="Score calls per group, the first included (each on the next "
                              "address, after retry_backoff_seconds, doubling)")
    retry_backoff_seconds: float = Field(0.5, ge=0, description="wait before the first retry, in seconds")
    max_consecutive_failures: int = Field(
        5, ge=1, description="groups in a row the teacher could not score before the run is told, as a critical "
        "error (errors.policy decides). A group it could not score is given up and counted "
        "(teacher/failed_total); it is never trained without the teacher's log-probs"
    )
    groups_in_flight: int = Field(
        4, ge=0, description="groups awaiting the teacher's scores while generation goes on (rollout slots beyond "
        "worker.max_in_flight); 0 scores inside the generation slot"
    )


class AlgorithmConfig(StrictModel):
    name: str = Field("grpo", description="grpo | dapo | 'module:function' of your own processor")
    normalize_std: bool = Field(True, description="divide group-centred rewards by the group's std")
    dynamic_sampling: bool | None = Field(None, description="drop groups with equal rewards and refill; default on for dapo")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="overlong handling")
    train_batch_size: int = Field(32, ge=1, description="samples per TrainStep (a multiple of worker.group_size)")
    micro_batch_size: int = Field(0, ge=0, description="samples per micro-batch on the trainer; 0 for all")
    loss: LossConfig = Field(default_factory=LossConfig, description="loss sent with each TrainStep")
    teacher: TeacherConfig | None = Field(
        None, description="on-policy distillation: per-token advantages from a teacher's log-probs of the sampled "
        "tokens (docs/distillation.md)"
    )


class PoolConfig(StrictModel):
    store: Literal["simple", "grouped", "hierarchical"] | None = Field(
        None, description="trajectory store; default grouped when worker.group_size > 1"
    )
    keys: list[str] = Field(default_factory=lambda: ["task"], description="grouping keys (hierarchical: several)")
    buffer_size_limit: int | None = Field(
        None, ge=1, description="samples pooled before producers wait; default 2 x train_batch_size"
    )
    count_in_flight: bool = Field(
        False, description="count rollouts in flight against buffer_size_limit too (fresher data, less overlap)"
    )


class StalenessConfig(StrictModel):
    """How the bound on a trained token's staleness (batch-async: `threshold`; fully-async:
    `fully_async_bound`; sync: the schedule's lag) is kept.

    `pace`, the default, orders finished groups into batches by deadline (the last version each may be
    trained at) and closes a batch only when every group still in flight can meet its own, waiting for
    a straggler when it could not: no finished group goes over the bound, none is thrown away, and the
    lengths trained are the lengths generated (services/controller/batches/processor.py). The price is
    trainer idle time while it waits for a straggler (below: the default's slack keeps it within
    drop's). `drop` batches finished groups in completion order and drops a group that finished too
    late for the bound, retrying its task: its rollout compute is lost, and since the
    groups that finish late are the long answers, training leans towards short ones (and a prompt whose
    answers are always long may be retried again and again). Sync mode neither drops nor waits under
    either. `correct` trains late groups with the trainer's truncated importance-sampling correction
    instead (algorithm.loss.is_cap).

    Whatever the mode and policy, the bound is enforced per token where samples are consumed (the batch
    a group joins): a generation that ran across weight updates carries the version of each token, and a
    token older than the bound is masked out of the loss (drop, pace) or trained with the correction
    (correct), while its younger neighbours in the same sample train as they are
    (services/controller/batches/batching.py). metrics.jsonl has the age of every trained token
    (staleness/token_age_*) and the tokens masked (staleness/masked_tokens*).

    `lookahead` below `threshold` buys pace its slack: rollouts start at most `lookahead` versions
    ahead (so samples are about as fresh as with threshold = lookahead), and a group that runs long
    may still be trained up to `threshold` versions late before the trainer waits for it. That is the
    default: threshold 2 and, under pace, lookahead threshold - 1. On a long-tailed mix
    (tests/unit/controller/test_controller_pacing.py, simulated) it keeps the mean age near 1, drops
    nothing and idles within drop's (threshold 1) + 0.05, the stated margin (0.185 vs 0.165), where
    pace with threshold 1 and no slack idles twice as much (0.33).
    """

    threshold: int = Field(2, ge=0, description="batch-async: most versions a trained sample may lag the trainer")
    lookahead: int | None = Field(
        None, ge=0, description="batch-async: most versions ahead of the trainer a rollout may be started for (how "
        "far replicas may lag); default threshold - 1 under policy pace with a threshold of 2 or more (one version "
        "of slack, no less than the sync schedule's lag), else threshold. Below the threshold, groups keep "
        "threshold - lookahead versions of slack, which policy pace uses before it waits for a late group"
    )
    policy: Literal["drop", "pace", "correct"] = Field(
        "pace", description="keeping the bound: pace (batch groups by deadline and wait for a late group rather than "
        "drop it: nothing is lost, no length bias, some trainer idle time), drop (batch groups in completion order; "
        "a group over the bound is dropped and its task retried) or correct (train late groups with IS correction). "
        "Tokens past the bound are masked out of the loss (pace, drop) or corrected (correct)"
    )
    fully_async_bound: int = Field(
        4, ge=0, description="fully-async: most versions a trained token may lag the trainer's version; older "
        "tokens are masked out of the loss (policy pace or drop) or trained with the IS correction (correct). "
        "Nothing waits for it: rollouts are never held back in fully-async"
    )


class SyncConfig(StrictModel):
    method: SyncMethodName = Field(
        "memory", description="how weights travel: memory (through the synchronizer; no shared disk needed), "
        "checkpoint (safetensors on shared storage) or nccl (process groups: nccl on GPUs, gloo on CPUs)",
    )
    style: SyncStyleName = Field("fixed", description="when rollouts sync")
    interval: int = Field(1, ge=1, description="sync every N trainer steps")
    offset: int = Field(0, ge=0, description="steps before the first sync")
    timeout_seconds: float = Field(
        120.0, gt=0, description="the policy's timeout: how long a replica's generation waits for the version its "
        "step needs (then ABORTED and retried), a DYNAMIC sync request stays open, and the run waits for a version "
        "it asked for (start, resume, validation), in seconds",
    )
    pause_mode: PauseMode = Field(
        "keep", description="what a replica does with its in-flight requests while it swaps weights: abort (they end "
        "and are retried), wait (they finish first, on the old weights), keep (frozen, they continue on the new ones)"
    )
    verify_timeout_seconds: float | None = Field(
        None, gt=0, description="how long a train step waits for a rollout replica's report that it verified each "
        "weight version the batch's tokens came from (a replica reports before it generates on a version, so the "
        "report is normally there and nothing waits), in seconds; default sync.timeout_seconds. Past it with no "
        "replica that verified the version (nor one serving it unverified under a synchronizer policy that accepts "
        "that), the batch is not trained and the run stops with a critical error naming each replica's verdict"
    )


class ValidationConfig(StrictModel):
    interval: int = Field(0, ge=0, description="validate every N weight versions; 0 never")
    before_training: bool = Field(False, description="validate once before the first step")
    max_samples: int | None = Field(None, ge=1, description="validate on the first N tasks only")
    group_size: int = Field(1, ge=1, description="completions per validation task")
    sampling: SamplingConfig | None = Field(None, description="sampling for validation; default greedy")
    max_in_flight: int | None = Field(
        None, ge=1,
        description="validation requests in flight at once; default all of them, so the engine batches the whole "
        "pass (training rollouts are paused meanwhile, so worker.max_in_flight does not apply)",
    )


class CheckpointConfig(StrictModel):
    interval: int = Field(0, ge=0, description="checkpoint every N steps; 0 only at the end")
    at_end: bool = Field(True, description="checkpoint when the run finishes")
    remove_previous: bool = Field(False, description="delete older checkpoints after a save")


class ResumeConfig(StrictModel):
    from_: Literal["none", "latest"] | str = Field(
        "none", alias="from", description="none | latest | a checkpoint path"
    )


class ErrorsConfig(StrictModel):
    policy: Literal["stop_on_error", "stop_on_critical", "continue"] = Field(
        "stop_on_critical", description="which recorded errors stop the run"
    )
    max_recorded: int = Field(1000, ge=1, description="errors kept for status")


class MetricsConfig(StrictModel):
    jsonl: bool = Field(True, description="write metrics.jsonl in the run directory")
    tensorboard_dir: Path | None = Field(None, description="also write TensorBoard events here (needs tensorboard)")
    wandb_project: str | None = Field(None, description="also log to this W&B project (needs wandb)")


class RunSection(StrictModel):
    name: str = Field("run", description="run name")
    seed: int = Field(0, description="seed of data shuffling and sampling")
    max_steps: int | None = Field(None, ge=1, description="stop after N trainer steps; default when data runs out")
    output_dir: Path | None = Field(None, description="run directory; default <runs_dir>/<run id>")


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
        if (self.worker.type == "openenv") != (self.worker.env is not None):
            raise ValueError("worker.env: the openenv worker needs its environment server (worker.env.url), and only "
                             "it takes one")
        if self.worker.type == "openenv" and (self.worker.instruction or not self.worker.chat
                                              or self.worker.tools or self.worker.tool_result_template):
            raise ValueError("worker: the openenv worker shows the model the environment's observations as chat "
                             "messages; instruction, chat false, tools and tool_result_template are not used by it")
        if self.worker.type == "openenv" and "reward" in self.model_fields_set:
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
        is_cap = loss.is_cap or (2.0 if self.mode != "sync" and self.staleness.policy == "correct" else 0.0)
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
