"""What a run's trajectories are worth and how they are learned from: the `reward` and `algorithm`
sections (a remote judge, the loss, a distillation teacher)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from flywheel.trainer.types import DAPO_CLIP_HIGH, Aggregation, ClippedLossKind
from flywheel.runtime.config import StrictModel


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


#: algorithm.loss.is_cap when the run names none (LossConfig.is_cap says why).
DEFAULT_IS_CAP = 2.0


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
    is_cap: float | None = Field(
        None, ge=0, description="truncated importance-sampling cap: the surrogate's ratio is taken against the "
        "trainer's own log-probs (the proximal policy) and each token's loss weighted by min(trainer / sampler "
        "probability, is_cap), which corrects the sampler's numerics and staleness (verl's TIS, TRL's vLLM "
        "correction); none: 2; 0: the ratio against the sampler's log-probs, uncorrected (the sampler's rounding "
        "then clips tokens: bench/trl_grpo.py measured 0.55 held-out accuracy at step 10 that way, 0.63 with 2)")


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
