"""Configuration of the trainer service.

Imported by `python -m services.trainer` before arguments are parsed, so it
must stay free of torch/transformers imports (`--help` answers instantly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from flywheel.runtime.config import StrictModel
from flywheel.runtime.server_config import ServerConfig
from flywheel.trainer.types import DAPO_CLIP_HIGH, Aggregation, LossKind
from flywheel.synchronizer.presence_config import PresenceConfig



class LoraConfig(StrictModel):
    enabled: bool = Field(False, description="train LoRA adapters (peft) instead of every parameter")
    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha (the update is scaled by alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description='module names that get adapters, or ["all-linear"]',
    )


class ModelConfig(StrictModel):
    path: Path | None = Field(None, description="HF model directory to train; none serves GetInfo only")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the dtype of the versions this trainer publishes, for rollouts that serve it: each "
        "export casts the floating tensors to it (the trainer keeps training in `dtype`), and the version's "
        "digests and probe are those of the cast tensors; none: `dtype`, as trained"
    )
    device: str = Field("cpu", description='torch device, e.g. "cpu" or "cuda:0"')
    autocast: Literal["none", "auto", "bfloat16", "float16"] = Field(
        "none", description="mixed precision: forward matmuls in this dtype, parameters, gradients and optimizer "
        "state in `dtype`. bfloat16 is 2-3x faster on GPUs and CPUs with AMX, but emulated (many times slower) "
        "on CPUs without AVX-512; auto: bfloat16 where the device has it natively, else none"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    compile: bool = Field(
        False, description="compile each decoder layer's forward with torch.compile (inductor): fewer, fused "
        "kernels, for GPUs, where a step of a small model is bound by Python's kernel launches. The first steps "
        "(and a batch of a new shape, until shapes are compiled as dynamic) pay the compilation; refused for "
        "mixture-of-experts models (routing replay hooks their routers at every forward, untried with compiled layers)")
    routing_replay: bool = Field(
        True, description="mixture-of-experts models: replay the experts the rollout's routers chose (TrainBatch "
        "routed_experts) in the policy's and the reference's forward, the gate weights still from the trainer's own "
        "router logits; off: route anew (the flip fraction is reported either way, routing_flip_fraction)")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="attention kernel of transformers")
    cpu_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 keeps torch's default (one per core); set it when "
        "several services share a machine's cores"
    )
    seed: int = Field(0, description="seed of torch/python/numpy RNGs at load time")
    deterministic: bool = Field(
        True, description="use deterministic torch kernels (exact resume; may be slower on CUDA)"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="optional LoRA adapters")


class ReferenceConfig(StrictModel):
    path: Path | None = Field(
        None, description="reference model directory for the KL term; none means the policy's initial weights"
    )
    preload: bool = Field(
        False, description="load the reference at startup; otherwise on the first call that needs it (kl_coef > 0)"
    )


class OptimizerConfig(StrictModel):
    lr: float = Field(1e-6, gt=0, description="peak learning rate of AdamW")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay (not applied to biases and norms)")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr, in optimizer steps")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning-rate schedule after warm-up"
    )
    total_steps: int = Field(
        0, ge=0, description="steps over which linear/cosine decay to min_lr_ratio*lr; required by those schedules "
        "(from a run file's launch.trainer, unset means run.max_steps)"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final learning rate of a decaying schedule, as a fraction of lr")
    max_grad_norm: float = Field(1.0, ge=0, description="clip the global L2 gradient norm to this; 0 disables clipping")

    @model_validator(mode="after")
    def _decay_needs_total(self) -> OptimizerConfig:
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"optimizer.total_steps must exceed warmup_steps for the {self.schedule} schedule")
        return self


class LossConfig(StrictModel):
    """Defaults for the LossSpec fields a request leaves unset (0 / UNSPECIFIED).

    kl_coef, entropy_coef and is_cap are taken from the request as they are
    (0 there means "off"), as the proto documents.
    """

    kind: LossKind = Field("grpo", description="loss when the request says LOSS_KIND_UNSPECIFIED")
    clip_low: float = Field(0.2, gt=0, lt=1, description="lower clip epsilon when the request sends 0 (not for cispo: "
                            "its unset clip is Tinker's, the ratio in [0, 4])")
    clip_high: float | None = Field(
        None, gt=0, description=f"upper clip epsilon when the request sends 0 (not for cispo); none: {DAPO_CLIP_HIGH} "
        "for dapo, clip_low otherwise"
    )
    aggregation: Aggregation | None = Field(
        None, description="aggregation when unspecified; none: seq_mean_token_mean for grpo, sum for Tinker's "
        "cross_entropy, importance_sampling and cispo, token_mean otherwise. "
        "Sequences with no loss token count in no denominator (seq_* modes count only sequences with one)"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="estimator of KL(policy || reference)")
    max_response_length: int = Field(
        0, ge=0, description="seq_mean_token_sum_norm (Dr. GRPO): the maximum completion length each sequence's "
        "token sum is divided by, when the request sends 0, in tokens"
    )


class LimitsConfig(StrictModel):
    max_batch_tokens: int = Field(262_144, ge=1, description="largest B*T of one request, in tokens")
    max_micro_batch_tokens: int = Field(
        0, ge=0, description="largest B*T of one forward pass (micro-batch), in tokens; 0: no limit"
    )
    max_sequence_length: int = Field(32_768, ge=2, description="largest T of a batch, in tokens")
    max_models: int = Field(
        16, ge=1, description="most LoRA models held on the one base (SelectModel); each costs its adapters "
        "about four times over (values, gradients, two Adam moments)"
    )


class CheckpointConfig(StrictModel):
    dir: Path = Field(Path("checkpoints"), description="where global_step_N/ directories are written")
    keep_last: int = Field(0, ge=0, description="keep this many newest checkpoints after a save; 0 keeps all")
    resume_latest: bool = Field(False, description="at startup, load the newest complete checkpoint under dir if any")
    allowed_roots: list[Path] = Field(
        default_factory=list, description="directories, besides dir and sync.publish_dir, that a request's paths "
        "(SaveCheckpoint, LoadCheckpoint, ExportWeights) may lie in; any other path is refused (PERMISSION_DENIED)"
    )


class SyncConfig(PresenceConfig):
    """The trainer's link to the synchronizer; the presence fields
    (advertise_address, heartbeat, deadlines, retries) are `PresenceConfig`'s."""

    synchronizer_address: str | None = Field(
        None, description='synchronizer "host:port": the loaded trainer registers there (and heartbeats its step '
        "and weight version), publishes every version the synchronizer's policy makes due (services.trainer."
        "publisher), and ExportWeights calls use it; none: standalone, not registered, publishes nothing"
    )
    publish: bool = Field(
        True, description="publish every version the synchronizer's policy makes due, by itself, after the step "
        "that made it (services.trainer.publisher); off: only ExportWeights calls (an operator) move weights"
    )
    publish_dir: Path | None = Field(
        None, description="CHECKPOINT policy: where published versions are written (version_N/, shared with the "
        "rollouts); none: <checkpoint.dir>/published"
    )
    trainer_id: str = Field(
        "trainer-0", min_length=1, description="this trainer's component id at the synchronizer (registrations); "
        "the controller's services.trainer_id must name it"
    )
    shared_memory_push: bool = Field(
        True, description="MEMORY pushes: when the synchronizer is on this host (it maps the segment in its "
        "shared_memory_dir, /dev/shm by default), write the payloads there and stream only their headers, about 3x "
        "the gRPC stream's speed (bench/weight_plane.py); holds one version in /dev/shm for the trainer's life. "
        "A synchronizer elsewhere gets the payloads in the stream either way"
    )


class ParallelConfig(StrictModel):
    world_size: int = Field(
        1, ge=1, description="ranks of the policy (one process per GPU, started by the service on this machine; "
        "the model sharded over them with FSDP2, the batch split across them); 1: one process, unsharded"
    )
    shard: bool = Field(False, description="shard with FSDP2 even at world_size 1 (world_size > 1 always does)")
    timeout_seconds: float = Field(
        600.0, gt=0, description="how long a rank waits for the others (start-up, each collective), in seconds"
    )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.shard


class TrainerConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50052, metrics_port=9092), description="gRPC server"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="reference model for KL")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW and its schedule")
    loss: LossConfig = Field(default_factory=LossConfig, description="loss defaults")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="batch size limits")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="weight export to the synchronizer")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="ranks of a sharded (FSDP2) policy")

    @model_validator(mode="after")
    def _parallel_without_lora(self) -> TrainerConfig:
        if self.parallel.enabled and self.model.lora.enabled:
            raise ValueError("parallel: a sharded policy (world_size > 1 or shard) does not train LoRA adapters yet")
        return self

    @model_validator(mode="after")
    def _publish_dtype_of_full_weights(self) -> TrainerConfig:
        # The probe of a cast version is the forward of the cast tensors swapped into the model: written for an
        # unsharded model's full weights, not yet for adapters (served over a base) or shards.
        cast = self.model.publish_dtype not in (None, self.model.dtype)
        if cast and (self.parallel.enabled or self.model.lora.enabled):
            raise ValueError(f"model.publish_dtype {self.model.publish_dtype}: a version cast from "
                             f"{self.model.dtype} is published for an unsharded policy without LoRA only")
        return self
