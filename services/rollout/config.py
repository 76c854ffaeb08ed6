"""Configuration of the rollout service (imports nothing heavy: `--help` stays instant)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from flywheel.common.types import LogprobsMode, PauseMode
from flywheel.runtime.config import StrictModel, checkpoint_root_field
from flywheel.runtime.server_config import ServerConfig
from flywheel.synchronizer.presence_config import PresenceConfig


class EngineConfig(StrictModel):
    kind: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="inference engine; auto picks vllm when installed, else transformers"
    )
    model_path: Path | None = Field(
        None, description="HF model directory to serve; none starts the service without an engine (generation fails)"
    )
    served_model_name: str | None = Field(
        None, description="model name in /v1/models and responses; default: the model directory's name"
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="engine arguments passed to vLLM's AsyncEngineArgs untouched (e.g. {max_model_len: 1024}); "
        "the transformers engine reads device (default cpu), dtype, max_model_len, max_num_seqs, seed and "
        "tokenizer from them",
    )
    initial_version: int = Field(0, ge=0, description="weight version of the weights in model_path (0: base model)")
    logprobs: LogprobsMode = Field(
        "processed", description="which log-probs samples carry: processed, of the distribution each token was drawn "
        "from (after penalties, temperature, top-k and top-p, renormalised; what RL's importance ratios need); raw, "
        "the model's own distribution (vLLM's default). A request may ask for the other kind "
        "(SamplingParams.logprobs_mode): the transformers engine serves it, vLLM refuses it where the two differ"
    )
    max_kept_ids: int = Field(
        64, ge=0, description="where top-k, top-p or a grammar cut the vocabulary before a token was drawn, its "
        "sample records the kept set for the trainer (common.Sample kept_sets): its ids when it has at most this "
        "many tokens, else its size alone (the transformers engine; vLLM records the sets it sees whole in its processed "
        "top log-probs, asking for max_kept_ids + 1 of them where a cut applies, and only those)"
    )
    cpu_cores: str = Field(
        "", description="on a CPU, the cores the engine computes on: all, or a list of cores and ranges "
        "(0-3,6); vLLM runs one OpenMP thread bound to each (its engine core spawned with OMP_NUM_THREADS, "
        "OMP_PLACES and OMP_PROC_BIND where one worker serves the model, inside the engine core's process; "
        "with tensor or pipeline parallelism its workers bound by VLLM_CPU_OMP_THREADS_BIND, none reserved), "
        "the transformers engine runs that many torch threads. Empty: the engine's default (vLLM with one "
        "worker, OpenMP's: one thread per core, unbound; with several, every core of a NUMA node but one, "
        "which it leaves to its engine core; transformers, one thread per core)"
    )
    tool_parser: Literal["hermes"] = Field(
        "hermes", description="how the served model writes tool calls (parsed into OpenAI tool_calls, and the "
        "format forced tool calls are constrained to); hermes: <tool_call>{json}</tool_call>, as Qwen and SmolLM2"
    )

    @field_validator("cpu_cores")
    @classmethod
    def _cores_listed(cls, value: str) -> str:
        if value not in ("", "all"):
            cpu_list(value)
        return value

    def cores(self) -> list[int] | None:
        """The cores `cpu_cores` names (None: the engine's default)."""
        if not self.cpu_cores:
            return None
        if self.cpu_cores == "all":
            return sorted(os.sched_getaffinity(0))
        return cpu_list(self.cpu_cores)


def cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (the kernel's cpu-list format); ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"cpu_cores: {text!r} is not all, nor a list of cores and ranges such as 0-3,6")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


class LimitsConfig(StrictModel):
    max_pending_requests: int = Field(
        512,
        ge=1,
        description="samples (prompts x n) admitted and not finished, running or waiting; past it new work is "
        "refused with RESOURCE_EXHAUSTED / HTTP 429",
    )
    retry_after_seconds: float = Field(
        1.0, gt=0, description="retry hint sent with RESOURCE_EXHAUSTED / 429, in seconds; each refusal says a random "
        "delay between it and twice it, so clients refused together do not retry together"
    )
    max_prompts_per_request: int = Field(1024, ge=1, description="most prompts one Generate call may carry")
    max_top_logprobs: int = Field(20, ge=0, description="largest top_logprobs a request may ask for, in tokens")
    max_score_sequences: int = Field(
        256, ge=1, description="most sequences one Score call may carry; past it RESOURCE_EXHAUSTED"
    )
    max_score_tokens: int = Field(
        65536, ge=1, description="most tokens one Score call may carry, all its sequences together (a prefill of "
        "them all); past it RESOURCE_EXHAUSTED"
    )


class UpdatesConfig(StrictModel):
    default_pause_mode: PauseMode = Field(
        "keep", description="in-flight policy of an update that names none (the synchronizer's policy names one "
        "for the updates it makes due): keep (freeze: in-flight requests go on with the new weights, none is "
        "aborted, and each token records the version that produced it), wait (drain) or abort"
    )
    timeout_seconds: float = Field(
        300.0, gt=0, description="default deadline of fetching and staging one weight update, in seconds"
    )
    checkpoint_root: Path | None = checkpoint_root_field("a checkpoint path this replica is sent", "updates")
    reuse_staging: bool = Field(
        True, description="keep the CPU tensors a MEMORY update was staged in and stage the next one into them "
        "(no page faults per update; holds one model's worth of memory between updates)"
    )
    delta_pulls: Literal["auto", "on", "off"] = Field(
        "auto", description="ask the synchronizer for each MEMORY version as a delta from the served weights "
        "(a few percent of a bfloat16 model per step; verified against the version's identity, pulled in full "
        "when it does not apply): auto does so when the last pull came over the network rather than from the "
        "synchronizer's shared memory; the transformers engine on CPU only (vLLM pulls in its worker: full)"
    )
    serve_peers: bool = Field(
        False, description="serve the verified version this replica holds to replicas of its synchronizer.site "
        "(services.rollout.weights.peers): one that joins or lags pulls it from here instead of across the link, "
        "verified against the version's identity; needs a site and an engine that holds its weights on the host "
        "(the transformers engine on CPU; refused at start otherwise)"
    )
    compress_pulls: Literal["auto", "on", "off"] = Field(
        "auto", description="ask the synchronizer for MEMORY versions with each chunk zstd-compressed (about 22 % "
        "smaller in bfloat16, 9 % in float32; it pays below about 100 MB/s): auto does so once a pull over the "
        "network measured the link below 50 MB/s"
    )
    apply_timeout_seconds: float = Field(
        120.0, gt=0, description="deadline of loading a staged version into the engine (generation is paused "
        "meanwhile); past it the update fails and the replica is quarantined, in seconds"
    )
    prepare_outside_pause: bool | None = Field(
        None, description="vLLM: load (and on CPU repack for its kernels) each MEMORY or NCCL version into a "
        "second copy of the model's weights while generation goes on, so that generation's pause only swaps "
        "the copies (pointers); costs one more model's worth of memory while an update is prepared. Off: vLLM "
        "reloads in place inside the pause (CHECKPOINT versions always do). Default (null): on where vLLM runs "
        "on the CPU, whose in-place reload repacks every linear layer inside the pause (about 3x the transfer "
        "on the 0.5B shape, docs/verification.md); off on a GPU, where the in-place reload is short and the "
        "second copy would take GPU memory"
    )
    probe: bool = Field(
        True, description="score the version's probe batch (flywheel.probe: the trainer's log-probs of fixed "
        "token sequences, 60 tokens) on the resident weights before generation reopens: the behavioural check for "
        "the tensors an engine cannot read back (vLLM's repacked linear layers) and a second line everywhere; it "
        "costs about a forward of 64 tokens inside the pause. Off: an engine that cannot read every tensor back "
        "reports its updates UNVERIFIED"
    )
    probe_tolerance: float | None = Field(
        None, gt=0, description="the bound, in nats, on the engine's statistic of the per-token differences between "
        "the replica's probe log-probs and the trainer's (the median on vLLM, whose kernels are not the trainer's; "
        "the largest difference on the transformers engine); none: the engine's own, measured per engine and dtype "
        "(docs/verification.md)"
    )
    faults_file: Path | None = Field(
        None, description="FAULT INJECTION, for tests and drills: a JSON file read at every update; while it "
        "exists its keys take effect on the load (services.rollout.engine.base.LoadFaults): corrupt_readable "
        "(one element of a tensor the engine can read back, changed), scale_linear (a linear layer's weight scaled "
        "by this factor), swap_same_shaped (two same-shaped tensors swapped by the loader), skip_one (one tensor "
        "left at the previous version), raise_halfway (the load raises RuntimeError halfway), and "
        "apply_delay_seconds (the apply hangs this long). Unset in production"
    )


class AdaptersConfig(StrictModel):
    max_resident: int = Field(
        0, ge=0, description="LoRA adapters kept loaded at once beside the base weights, each served to the "
        "requests that name it (Generate's adapter; the Tinker gateway's saves for the sampler); past it the least "
        "recently used one not in use is unloaded, and loaded again from its files when asked for. 0: no adapters "
        "(vLLM: also sizes enable_lora, max_loras and max_cpu_loras)"
    )
    max_rank: int = Field(64, ge=1, description="largest LoRA rank an adapter may have (vLLM: max_lora_rank)")


class SessionsConfig(StrictModel):
    ttl_seconds: float = Field(
        1800.0, gt=0, description="an agent session's records are freed this long after its last use, in seconds "
        "(unless the controller that opened it asks for another ttl)"
    )
    max_open: int = Field(4096, ge=1, description="sessions kept at once; opening more is refused (HTTP 429)")


class SynchronizerLinkConfig(PresenceConfig):
    """Where and as whom the rollout registers (it then follows the
    synchronizer's policy: services.rollout.weights.follower); the shared fields (advertise_address, heartbeat, deadlines, retries) are
    `PresenceConfig`'s."""

    address: str = Field(
        "", description='synchronizer "host:port" to register with, heartbeat to and report weight updates to; '
        "empty: standalone (nothing is registered)"
    )
    component_id: str = Field(
        "", description="id of this rollout at the synchronizer (must be unique in the run, and equal the replica "
        "name the controller uses for NCCL groups: its services.rollout[].id); empty: rollout-<host>-<grpc port>"
    )
    site: str = Field(
        "", description="the site this replica runs at (a label): MEMORY versions are pulled from a relay of the "
        "same site that the synchronizer's registry lists (services.synchronizer.relay), falling back to the "
        "synchronizer itself when none is up or it fails; empty: always from the synchronizer"
    )


class RolloutConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=50053, metrics_port=9093), description="gRPC server"
    )
    http_port: int = Field(
        8000, ge=0, le=65535, description="OpenAI-compatible HTTP port (on server.host); 0 picks a free one"
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the inference engine")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="backpressure and request limits")
    updates: UpdatesConfig = Field(default_factory=UpdatesConfig, description="weight updates")
    adapters: AdaptersConfig = Field(
        default_factory=AdaptersConfig, description="LoRA adapters served beside one another on the base weights; "
        "their paths must lie inside updates.checkpoint_root"
    )
    sessions: SessionsConfig = Field(
        default_factory=SessionsConfig, description="external agents' sessions (token-exact records per episode)"
    )
    synchronizer: SynchronizerLinkConfig = Field(
        default_factory=SynchronizerLinkConfig, description="registration with the synchronizer and following it"
    )
