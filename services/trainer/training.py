"""The training engine: the domain behind every trainer RPC.

One `TrainingEngine` owns one `Policy`. Its methods are blocking and meant to
run in a worker thread; they are serialised by one lock, so a training step,
a checkpoint save and a log-prob pass never interleave, while `info()` reads
plain integers without waiting for them.

Every method validates its whole request before it touches the model or the
optimizer, and a failure half-way through a step (a non-finite loss or
gradient) discards the gradients it produced, so a rejected call leaves the
parameters and optimizer state as they were.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.runtime.paths import confine
from services.trainer import checkpoints
from services.trainer.batch import Batch, BatchLimits, input_batch, training_batch
from services.trainer.config import LossConfig, TrainerConfig
from services.trainer.forward import token_logprobs
from flywheel.trainer.types import AGGREGATIONS
from flywheel.trainer.types import LOSS_KINDS as KINDS
from services.trainer.losses import (
    LossOutput,
    LossSettings,
    default_aggregation,
    default_clip_high,
    loss_denominators,
    policy_loss,
)
from services.trainer.policy import Policy, autocast_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossRequest:
    """A loss as a caller specified it: None / 0 where it left a field unset."""

    kind: str | None = None
    clip_low: float = 0.0
    clip_high: float = 0.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str | None = None
    is_cap: float = 0.0
    max_response_length: int = 0


def resolve_loss(request: LossRequest, defaults: LossConfig) -> LossSettings:
    """Fills unset fields from the config and checks ranges, naming the field."""
    for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "is_cap"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"loss.{name}: must be a finite number >= 0, got {value}")
    kind = request.kind or defaults.kind
    if kind not in KINDS:
        raise InvalidArgument(f"loss.kind: unknown {kind!r}")
    clip_low = request.clip_low or defaults.clip_low
    if clip_low >= 1:
        raise InvalidArgument(f"loss.clip_low: must be < 1, got {clip_low}")
    clip_high = request.clip_high or defaults.clip_high or default_clip_high(kind, clip_low)
    aggregation = request.aggregation or defaults.aggregation or default_aggregation(kind)
    if aggregation not in AGGREGATIONS:
        raise InvalidArgument(f"loss.aggregation: unknown {aggregation!r}")
    max_response_length = request.max_response_length or defaults.max_response_length
    if aggregation == "seq_mean_token_sum_norm" and max_response_length < 1:
        raise InvalidArgument(
            "loss.max_response_length: seq_mean_token_sum_norm divides by the maximum completion length; "
            "set it in the request or the trainer's loss.max_response_length"
        )
    return LossSettings(
        kind=kind, clip_low=clip_low, clip_high=clip_high, kl_coef=request.kl_coef,
        entropy_coef=request.entropy_coef, aggregation=aggregation, is_cap=request.is_cap,
        kl_estimator=defaults.kl_estimator, max_response_length=max_response_length,
    )


@dataclass
class Info:
    model_name: str
    parameter_count: int
    trainable_count: int
    dtype: str
    device: str
    step: int
    weight_version: int
    ready: bool


@dataclass
class StepResult:
    step: int
    weight_version: int
    tokens: int = 0
    loss_tokens: int = 0
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class TrainingEngine:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.policy: Policy | None = None
        self._lock = threading.Lock()
        self._autocast = autocast_dtype(config.model.autocast, config.model.device)
        # Every step runs on this one thread. glibc gives each thread that allocates its own heap and keeps
        # what is freed there: steps spread over a pool's threads left one step's activations (GBs) resident
        # per thread, and a 64-sample SmolLM2 run grew past 18 GB until the kernel killed it.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")

    async def run(self, fn: Callable, *args: object):
        """Awaits fn(*args) on the engine's compute thread (loading, steps, log-probs, checkpoints)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, functools.partial(fn, *args))

    @property
    def lock(self) -> threading.Lock:
        """The lock that serialises every use of the policy (weight exports take it
        while they read the live parameters; `info()` never does)."""
        return self._lock

    def ready_policy(self) -> Policy:
        """The loaded policy, or FailedPrecondition; call it holding `lock`."""
        return self._ready(None)

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Loads the policy (and resumes from the latest checkpoint if configured)."""
        policy = Policy.load(self.config)
        if self.config.checkpoint.resume_latest:
            found = checkpoints.latest(self.config.checkpoint.dir)
            if found is not None:
                checkpoints.load(policy, found)
        self.policy = policy

    def info(self) -> Info:
        p, m = self.policy, self.config.model
        if p is None:
            return Info(str(m.path or ""), 0, 0, m.dtype, m.device, 0, 0, False)
        return Info(p.name, p.parameter_count, p.trainable_count, m.dtype, str(p.device), p.step, p.weight_version, True)

    def _ready(self, expected_step: int | None) -> Policy:
        if self.policy is None:
            raise FailedPrecondition("no model loaded (start the trainer with --model.path)")
        if expected_step is not None and expected_step != self.policy.step:
            raise FailedPrecondition(f"expected_step: caller expects step {expected_step}, the trainer is at step {self.policy.step}")
        return self.policy

    def _limits(self, policy: Policy) -> BatchLimits:
        lim = self.config.limits
        return BatchLimits(lim.max_batch_tokens, lim.max_sequence_length, policy.vocab_size)

    def _micro_size(self, batch: Batch, micro_batch_size: int) -> int:
        size = batch.size if micro_batch_size <= 0 else min(micro_batch_size, batch.size)
        cap = self.config.limits.max_micro_batch_tokens
        if cap and size * batch.seq_len > cap:
            raise InvalidArgument(
                f"micro_batch_size: {size} samples x {batch.seq_len} tokens exceeds limits.max_micro_batch_tokens = {cap}"
            )
        return size

    def _training_batch(self, policy: Policy, tensors: Mapping[str, Tensor | None], loss: LossSettings) -> Batch:
        needs_behaviour = loss.is_cap > 0 or tensors.get("old_logprobs") is None
        return training_batch(
            tensors, self._limits(policy), weight_version=policy.weight_version, needs_behaviour=needs_behaviour
        )

    # ------------------------------------------------------------ training

    def _accumulate(self, policy: Policy, batch: Batch, loss: LossSettings, micro: int) -> LossOutput:
        """Forward + backward over micro-batches; gradients add up in .grad."""
        num_tokens, num_seqs = loss_denominators(batch.loss_mask)
        total: LossOutput | None = None
        policy.model.train()
        for start in range(0, batch.size, micro):
            mb = batch.rows(start, start + micro).to(policy.device)
            ref = mb.ref_logprobs
            if loss.kl_coef > 0 and ref is None:
                with torch.no_grad(), policy.reference_context() as reference:
                    ref, _ = token_logprobs(
                        reference, mb.input_ids, mb.attention_mask, select=mb.loss_mask, autocast=self._autocast
                    )
            # Only the loss mask's positions: the loss reads nothing else, and the output head is the costly part.
            logprobs, entropy = token_logprobs(
                policy.model, mb.input_ids, mb.attention_mask, select=mb.loss_mask, entropy=True,
                entropy_grad=loss.entropy_coef > 0, autocast=self._autocast,
            )
            out = policy_loss(
                loss, logprobs=logprobs, mask=mb.loss_mask, advantages=mb.advantages,
                behaviour_logprobs=mb.behaviour_logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=ref,
                entropy=entropy, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            if not torch.isfinite(out.loss):
                raise FailedPrecondition(f"loss is {float(out.loss.detach())} on samples {start}..{start + len(mb.input_ids) - 1}")
            out.loss.backward()
            total = out if total is None else total.merge(out)
        assert total is not None
        return total

    def _run_discarding_on_error(self, policy: Policy, fn, *args):
        """Runs fn; on failure drops whatever gradients exist so no half-step survives."""
        try:
            return fn(*args)
        except BaseException as exc:
            policy.zero_grad()
            if isinstance(exc, FailedPrecondition):
                raise FailedPrecondition(f"{exc}; accumulated gradients were discarded, parameters unchanged") from None
            raise

    def forward_backward(
        self, tensors: Mapping[str, Tensor | None], loss_request: LossRequest, expected_step: int | None = None
    ) -> StepResult:
        """Accumulates gradients of one batch; step and weight version stay as they are."""
        with self._lock:
            policy = self._ready(expected_step)
            loss = resolve_loss(loss_request, self.config.loss)
            batch = self._training_batch(policy, tensors, loss)
            micro = self._micro_size(batch, 0)
            out = self._run_discarding_on_error(policy, self._accumulate, policy, batch, loss, micro)
            return StepResult(policy.step, policy.weight_version, tokens=batch.real_tokens, loss_tokens=int(out.tokens),
                              metrics={**out.metrics(), **self._staleness(policy, batch)})

    def _optim(self, policy: Policy) -> tuple[float, float]:
        params = policy.trainable_parameters()
        if not any(p.grad is not None for p in params):
            raise FailedPrecondition("no accumulated gradients: call ForwardBackward first")
        lr = policy.learning_rate
        max_norm = self.config.optimizer.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(grad_norm):
            raise FailedPrecondition(f"gradient norm is {grad_norm}")
        policy.optimizer.step()
        policy.scheduler.step()
        policy.zero_grad()
        policy.step += 1
        policy.weight_version += 1
        return grad_norm, lr

    def optim_step(self, expected_step: int | None = None) -> StepResult:
        with self._lock:
            policy = self._ready(expected_step)
            grad_norm, lr = self._run_discarding_on_error(policy, self._optim, policy)
            return StepResult(policy.step, policy.weight_version, grad_norm=grad_norm, learning_rate=lr)

    def train_step(
        self, tensors: Mapping[str, Tensor | None], loss_request: LossRequest, micro_batch_size: int = 0,
        expected_step: int | None = None,
    ) -> StepResult:
        """ForwardBackward over micro-batches of one batch, then OptimStep."""
        with self._lock:
            started = time.perf_counter()
            policy = self._ready(expected_step)
            loss = resolve_loss(loss_request, self.config.loss)
            batch = self._training_batch(policy, tensors, loss)
            micro = self._micro_size(batch, micro_batch_size)
            if policy.has_gradients():
                raise FailedPrecondition("gradients from ForwardBackward are pending: call OptimStep first")

            def step() -> tuple[LossOutput, float, float]:
                out = self._accumulate(policy, batch, loss, micro)
                return (out, *self._optim(policy))

            out, grad_norm, lr = self._run_discarding_on_error(policy, step)
            metrics = {**out.metrics(), **self._staleness(policy, batch, before_step=True),
                       "grad_norm": grad_norm, "learning_rate": lr,
                       # Validation + compute, without the wire: callers can tell RPC overhead apart.
                       "step_seconds": time.perf_counter() - started}
            return StepResult(policy.step, policy.weight_version, tokens=batch.real_tokens, loss_tokens=int(out.tokens),
                              grad_norm=grad_norm, learning_rate=lr, metrics=metrics)

    @staticmethod
    def _staleness(policy: Policy, batch: Batch, before_step: bool = False) -> dict[str, float]:
        if batch.weight_versions is None:
            return {}
        # Staleness of the samples against the weights that computed the gradient.
        current = policy.weight_version - (1 if before_step else 0)
        lag = (current - batch.weight_versions).float()
        return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}

    # ------------------------------------------------------------ inference

    def compute_logprobs(
        self, tensors: Mapping[str, Tensor | None], reference: bool = False, micro_batch_size: int = 0
    ) -> tuple[Tensor, int]:
        """Per-token log-probs [B, T] (float32, CPU) under the policy or the reference."""
        with self._lock:
            policy = self._ready(None)
            batch = input_batch(tensors, self._limits(policy))
            micro = self._micro_size(batch, micro_batch_size)
            pieces = []
            policy.model.eval()
            try:
                with torch.no_grad():
                    for start in range(0, batch.size, micro):
                        mb = batch.rows(start, start + micro).to(policy.device)
                        if reference:
                            with policy.reference_context() as model:
                                logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, autocast=self._autocast)
                        else:
                            logprobs, _ = token_logprobs(policy.model, mb.input_ids, mb.attention_mask, autocast=self._autocast)
                        pieces.append(logprobs.cpu())
            finally:
                policy.model.train()
            return torch.cat(pieces), policy.weight_version

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: Path | None = None, remove_previous: bool = False, client_state: bytes = b"") -> tuple[Path, int, int]:
        """Returns (path, step, size in bytes)."""
        with self._lock:
            policy = self._ready(None)
            cfg = self.config.checkpoint
            if directory is not None:
                directory = confine(directory, checkpoints.request_roots(self.config), "directory")
            path, size = checkpoints.save(
                policy, directory or cfg.dir, client_state=client_state, keep_last=cfg.keep_last,
                remove_previous=remove_previous,
            )
            return path, policy.step, size

    def load_checkpoint(self, path: Path | None = None, latest: bool = False) -> tuple[Path | None, int, int, bytes]:
        """Returns (path loaded or None when latest found none, step, weight_version, client_state)."""
        with self._lock:
            policy = self._ready(None)
            if path is None:
                if not latest:
                    raise InvalidArgument("path: empty; give a global_step_N directory or set latest")
                path = checkpoints.latest(self.config.checkpoint.dir)
                if path is None:
                    return None, policy.step, policy.weight_version, b""
            else:
                path = confine(path, checkpoints.request_roots(self.config), "path")
            step, version, client_state = checkpoints.load(policy, path)
            return path, step, version, client_state
