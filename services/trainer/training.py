"""The training engine: the domain behind every trainer RPC.

One `TrainingEngine` owns one `Policy`. Its methods are blocking and meant to
run in a worker thread; they are serialised by one lock, so a training step,
a checkpoint save and a log-prob pass never interleave, while `info()` reads
plain integers without waiting for them.

Every method validates its whole request before it touches the model or the
optimizer, and a failure half-way through a step (a non-finite loss or
gradient) discards the gradients it produced, so a rejected call leaves the
parameters and optimizer state as they were.

With `parallel` on, the policy is sharded over ranks (`distributed`): the
public methods validate on rank 0, then `_spmd` has every rank run the same
`_do_*` method on the same arguments, each on its own rows of the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from flywheel.errors import FailedPrecondition, FlywheelError, InvalidArgument
from flywheel.models.moe import RoutingStats
from flywheel.runtime.paths import confine
from flywheel.trainer.types import AdamStep, LoraShape
from services.trainer import checkpoints
from services.trainer.batch import Batch, BatchLimits, input_batch, training_batch
from services.trainer.config import TrainerConfig
from services.trainer.distributed import (
    ENV_RANK,
    RANK_SECTIONS,
    Ranks,
    gather_state,
    rank_device,
    rank_share,
    reshard,
)
from services.trainer.distributed import full as full_tensor
from services.trainer.files import request_roots
from services.trainer.forward import token_logprobs
from services.trainer.loss_request import LossRequest, resolve_loss
from services.trainer.losses import (
    LossOutput,
    LossSettings,
    loss_denominators,
    policy_loss,
)
from services.trainer.policy import Policy, autocast_dtype
from services.trainer.probe import probe_logprobs

log = logging.getLogger(__name__)


def _sampling(batch: Batch) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The batch's sampling contract, as token_logprobs takes it."""
    return batch.sampling_temperature, batch.sampling_top_k, batch.sampling_top_p


def _replayed(batch: Batch, replay: bool) -> dict:
    """What token_logprobs takes of the sampler beyond the distribution: its recorded kept sets and, for a
    mixture-of-experts model, its routing (replayed when the trainer's model.routing_replay is on)."""
    return {"kept": (batch.sampler_kept_size, batch.sampler_kept_ids), "routing": batch.routed_experts,
            "replay": replay}


def _routing_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """routing_flip_fraction: of the rollout's recorded routing decisions, those the trainer's own routers
    make otherwise (whether or not they were replayed)."""
    if metrics.get("routing_decisions"):
        metrics["routing_flip_fraction"] = metrics["routing_flips"] / metrics["routing_decisions"]
    return metrics


def _per_rank(micro: int, rows: int, world: int) -> int:
    """Micro-batch rows such that every rank has a share of the batch."""
    return max(1, min(micro, math.ceil(rows / world)))


def _unplanned(planned: Tensor, order: Tensor) -> Tensor:
    """Rows of a planned batch (Batch.planned) back in the request's order."""
    out = torch.empty_like(planned)
    out[order] = planned
    return out


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
    #: The LoRA adapters' rank and modules, from the config; 0 and () when every parameter trains.
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    #: The models held (`select_model`), the selected one first.
    model_ids: tuple[str, ...] = ("",)


@dataclass
class StepResult:
    step: int
    weight_version: int
    tokens: int = 0
    loss_tokens: int = 0
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    #: ForwardBackward: the current policy's log-prob of each token (ComputeLogprobs' layout, [B, T]) in
    #: the forward pass the gradients came from, under the batch's sampling distribution, at the loss
    #: mask's positions (the only ones the output head computes); 0 elsewhere.
    logprobs: Tensor | None = None


class TrainingEngine:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.policy: Policy | None = None
        #: This process's place among the ranks of a sharded policy (`parallel`); None: one unsharded process.
        self.ranks: Ranks | None = None
        self._lock = threading.Lock()
        self._autocast = autocast_dtype(config.model.autocast, config.model.device)
        #: Replay the rollout's recorded MoE routing in the policy's and the reference's forward.
        self._replay = config.model.routing_replay
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

    @property
    def sharded(self) -> bool:
        return self.ranks is not None

    def ready_policy(self) -> Policy:
        """The loaded policy, or FailedPrecondition; call it holding `lock`."""
        return self._ready(None)

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Loads the policy (and resumes from the latest checkpoint if configured).

        With `parallel` on, rank 0 (the service) first starts the other ranks,
        which load and shard the same policy (`services.trainer.distributed`)."""
        par = self.config.parallel
        if par.enabled:
            self._join_ranks()
        policy = Policy.load(self.config, shard=self.ranks is not None)
        if self.config.checkpoint.resume_latest:
            # Every rank finds the same directory: they share the machine's file system.
            found = checkpoints.latest(self.config.checkpoint.dir)
            if found is not None:
                self._load_from(policy, found)
        self.policy = policy

    def _join_ranks(self) -> None:
        par, device = self.config.parallel, self.config.model.device
        if ENV_RANK in os.environ:
            self.ranks = Ranks.join_from_env(device, par.timeout_seconds)
        else:
            sections = {k: v for k, v in self.config.model_dump(mode="json").items() if k in RANK_SECTIONS}
            log = f"{self.config.server.log_level} {self.config.server.log_format}"
            self.ranks = Ranks.start(sections, par.world_size, device, par.timeout_seconds, log)
        mine = rank_device(device, self.ranks.rank)
        if mine != device:
            self.config = self.config.model_copy(update={"model": self.config.model.model_copy(update={"device": mine})})

    def close(self) -> None:
        """Rank 0: stops the other ranks; every rank leaves the process group. Idempotent."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            with self._lock:
                ranks.close()

    def serve_commands(self) -> None:
        """Ranks 1..N-1: runs what rank 0 broadcasts until it says "stop"."""
        assert self.ranks is not None and self.ranks.rank > 0
        while True:
            name, args = self.ranks.receive()
            if name == "stop":
                return
            with self._lock:
                try:
                    getattr(self, f"_do_{name}")(*args)
                except FlywheelError as exc:
                    # Rank 0 ran into the same error and answers its caller.
                    log.info("rank command refused", extra={"command": name, "error": str(exc)})
                except Exception:  # noqa: BLE001 - keep serving; rank 0 reports its own failure
                    log.exception("rank command failed", extra={"command": name})

    def _spmd(self, name: str, *args: object):
        """Runs `_do_<name>(*args)` here and, on every other rank, the same (call it holding the lock)."""
        if self.ranks is not None and self.ranks.world_size > 1:
            self.ranks.command(name, args)
        return getattr(self, f"_do_{name}")(*args)

    def _rank_world(self) -> tuple[int, int]:
        return (self.ranks.rank, self.ranks.world_size) if self.ranks is not None else (0, 1)

    def info(self) -> Info:
        p, m = self.policy, self.config.model
        lora = (m.lora.rank, tuple(m.lora.target_modules)) if m.lora.enabled else (0, ())
        if p is None:
            return Info(str(m.path or ""), 0, 0, m.dtype, m.device, 0, 0, False, *lora)
        return Info(p.name, p.parameter_count, p.trainable_count, m.dtype, str(p.device), p.step, p.weight_version, True,
                    *lora, model_ids=p.model_ids)

    # ------------------------------------------------------------ models

    def select_model(self, model_id: str, shape: LoraShape = LoraShape()) -> tuple[bool, int]:
        """Makes `model_id` the model every later call trains, saves and exports (a new one starts
        from the adapters' initialisation, of `shape`); returns (created, its step)."""
        with self._lock:
            policy = self._ready(None)
            switched = model_id != policy.model_id
            created = policy.select(model_id, self.config.limits.max_models, shape)
            if switched:
                log.debug("model selected", extra={"model_id": model_id, "new_model": created, "step": policy.step,
                                                   "models": len(policy.model_ids)})
            return created, policy.step

    def drop_model(self, model_id: str) -> None:
        with self._lock:
            self._ready(None).drop(model_id)

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
        # cross_entropy reads no sampler's log-probs; importance_sampling always does.
        needs_behaviour = loss.kind != "cross_entropy" and (
            loss.kind == "importance_sampling" or loss.is_cap > 0 or tensors.get("old_logprobs") is None)
        return training_batch(
            tensors, self._limits(policy), weight_version=policy.weight_version, needs_behaviour=needs_behaviour
        )

    # ------------------------------------------------------------ training

    def _accumulate(
        self, policy: Policy, batch: Batch, loss: LossSettings, micro: int, backward: bool = True
    ) -> LossOutput | None:
        """Forward + backward over this rank's micro-batches; gradients add up in .grad
        (`backward=False`: the forward alone, under the caller's no_grad).

        Returns the whole batch's statistics on rank 0 (None on other ranks)."""
        num_tokens, num_seqs = loss_denominators(batch.loss_mask)
        rank, world = self._rank_world()
        total: LossOutput | None = None
        policy.model.train()
        # Rows of one prompt together, their prompt computed once (Batch.planned), and each micro-batch
        # cut to its own longest row: a batch is padded to its longest answer, and late in a run most
        # answers are a fraction of it. The loss's denominators are the whole batch's, so the order
        # changes nothing else.
        batch, order, plans = batch.planned(_per_rank(micro, batch.size, world))
        for plan in rank_share(plans, rank, world):
            # A rank without rows of its own still runs FSDP's collectives, on a stand-in row, times zero.
            start, stop, shared = (plan.start, plan.stop, plan.shared_prefix) if plan else (0, 1, 0)
            mb = batch.rows(start, stop).trimmed().to(policy.device)
            ref = mb.ref_logprobs
            if loss.kl_coef > 0 and ref is None:
                with torch.no_grad(), policy.reference_context() as reference:
                    ref, _ = token_logprobs(
                        reference, mb.input_ids, mb.attention_mask, select=mb.loss_mask, autocast=self._autocast,
                        sampling=_sampling(mb), shared_prefix=shared, **_replayed(mb, self._replay),
                    )
            # Only the loss mask's positions: the loss reads nothing else, and the output head is the costly part.
            routing = RoutingStats()
            logprobs, entropy = token_logprobs(
                policy.model, mb.input_ids, mb.attention_mask, select=mb.loss_mask, entropy=True,
                entropy_grad=loss.entropy_coef > 0, autocast=self._autocast, sampling=_sampling(mb),
                shared_prefix=shared, **_replayed(mb, self._replay), routing_stats=routing,
            )
            out = policy_loss(
                loss, logprobs=logprobs, mask=mb.loss_mask, advantages=mb.advantages,
                behaviour_logprobs=mb.behaviour_logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=ref,
                entropy=entropy, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            if routing.decisions:
                out.parts.update(routing_decisions=float(routing.decisions), routing_flips=float(routing.flips))
            finite = bool(torch.isfinite(out.loss))
            # Every rank learns of a bad loss before any raises: one rank leaving alone would leave the
            # others waiting in a collective that never comes.
            agreed = finite if world == 1 else self.ranks.all_agree(finite)  # type: ignore[union-attr]
            if not finite:
                rows_text = f"samples {sorted(order[start:stop].tolist())}" if plan is not None else "a stand-in row"
                raise FailedPrecondition(f"loss is {float(out.loss.detach())} on {rows_text}")
            if not agreed:
                raise FailedPrecondition("loss is not finite on another rank's samples")
            if plan is None:
                if backward:
                    (out.loss * 0).backward()
                continue
            out.row_logprobs.append((order[start:stop].cpu(), logprobs.detach().float().cpu()))
            # FSDP averages gradients over the ranks; the loss already divides by the whole batch.
            if backward:
                (out.loss * world if world > 1 else out.loss).backward()
            total = out if total is None else total.merge(out)
        if world == 1:
            assert total is not None
            return total
        mine = None if total is None else dataclasses.replace(total, loss=total.loss.detach().cpu())
        merged: LossOutput | None = None
        for part in self.ranks.gather(mine) or ():  # type: ignore[union-attr]
            if part is not None:
                merged = part if merged is None else merged.merge(part)
        return merged

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
        self, tensors: Mapping[str, Tensor | None], loss_request: LossRequest, expected_step: int | None = None,
        forward_only: bool = False,
    ) -> StepResult:
        """Accumulates gradients of one batch; step and weight version stay as they are.
        `forward_only`: the loss, metrics and log-probs alone; the gradients are not touched."""
        with self._lock:
            policy = self._ready(expected_step)
            loss = resolve_loss(loss_request, self.config.loss)
            batch = self._training_batch(policy, tensors, loss)
            micro = self._micro_size(batch, 0)
            out = self._spmd("forward" if forward_only else "accumulate", batch, loss, micro)
            return StepResult(policy.step, policy.weight_version, tokens=batch.real_tokens, loss_tokens=int(out.tokens),
                              metrics=_routing_metrics({**out.metrics(), **self._staleness(policy, batch)}),
                              logprobs=out.logprobs(batch.size, batch.seq_len))

    def _do_accumulate(self, batch: Batch, loss: LossSettings, micro: int) -> LossOutput | None:
        policy = self._ready(None)
        return self._run_discarding_on_error(policy, self._accumulate, policy, batch, loss, micro)

    def _do_forward(self, batch: Batch, loss: LossSettings, micro: int) -> LossOutput | None:
        # No gradients are made, so a failure leaves the accumulated ones as they were.
        with torch.no_grad():
            return self._accumulate(self._ready(None), batch, loss, micro, backward=False)

    def _optim(self, policy: Policy, adam: AdamStep | None = None) -> tuple[float, float]:
        params = policy.trainable_parameters()
        if not any(p.grad is not None for p in params):
            raise FailedPrecondition("no accumulated gradients: call ForwardBackward first")
        adam = adam or AdamStep()
        lr = policy.learning_rate if adam.learning_rate is None else adam.learning_rate
        configured = self.config.optimizer.max_grad_norm if adam.max_grad_norm is None else adam.max_grad_norm
        max_norm = configured or math.inf
        # A sharded policy's norm is a DTensor: its value is a collective over the ranks.
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        if not math.isfinite(grad_norm):
            raise FailedPrecondition(f"gradient norm is {grad_norm}")
        with policy.adam_overrides(adam):
            policy.optimizer.step()
        policy.scheduler.step()
        policy.zero_grad()
        policy.step += 1
        policy.weight_version = policy.next_version()
        return grad_norm, lr

    def optim_step(self, expected_step: int | None = None, adam: AdamStep | None = None) -> StepResult:
        """Applies the accumulated gradients; `adam`: this step's Adam parameters (the configured ones else)."""
        with self._lock:
            policy = self._ready(expected_step)
            if not policy.has_gradients():
                raise FailedPrecondition("no accumulated gradients: call ForwardBackward first")
            grad_norm, lr = self._spmd("optim", adam)
            return StepResult(policy.step, policy.weight_version, grad_norm=grad_norm, learning_rate=lr)

    def _do_optim(self, adam: AdamStep | None = None) -> tuple[float, float]:
        policy = self._ready(None)
        return self._run_discarding_on_error(policy, self._optim, policy, adam)

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
            out, grad_norm, lr = self._spmd("train", batch, loss, micro)
            metrics = {**out.metrics(), **self._staleness(policy, batch, before_step=True),
                       "grad_norm": grad_norm, "learning_rate": lr,
                       # Validation + compute, without the wire: callers can tell RPC overhead apart.
                       "step_seconds": time.perf_counter() - started}
            return StepResult(policy.step, policy.weight_version, tokens=batch.real_tokens, loss_tokens=int(out.tokens),
                              grad_norm=grad_norm, learning_rate=lr, metrics=_routing_metrics(metrics))

    def _do_train(self, batch: Batch, loss: LossSettings, micro: int) -> tuple[LossOutput | None, float, float]:
        policy = self._ready(None)

        def step() -> tuple[LossOutput | None, float, float]:
            out = self._accumulate(policy, batch, loss, micro)
            return (out, *self._optim(policy))

        return self._run_discarding_on_error(policy, step)

    @staticmethod
    def _staleness(policy: Policy, batch: Batch, before_step: bool = False) -> dict[str, float]:
        if batch.weight_versions is None:
            return {}
        # Staleness against the weights that computed the gradient: of each sample, or of each token the
        # loss reads when the batch says which version produced each token.
        current = policy.weight_version - (1 if before_step else 0)
        versions = batch.weight_versions
        if versions.dim() == 2:
            assert batch.loss_mask is not None
            versions = versions[batch.loss_mask > 0]
        lag = (current - versions).float()
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
            return self._spmd("logprobs", batch, reference, micro), policy.weight_version

    def _do_logprobs(self, batch: Batch, reference: bool, micro: int) -> Tensor | None:
        policy = self._ready(None)
        rank, world = self._rank_world()
        pieces = []
        policy.model.eval()
        batch, order, plans = batch.planned(_per_rank(micro, batch.size, world))
        try:
            with torch.no_grad():
                for plan in rank_share(plans, rank, world):
                    start, stop, shared = (plan.start, plan.stop, plan.shared_prefix) if plan else (0, 1, 0)
                    mb = batch.rows(start, stop).to(policy.device)
                    if reference:
                        with policy.reference_context() as model:
                            logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, autocast=self._autocast,
                                                         sampling=_sampling(mb), shared_prefix=shared,
                                                         routing=mb.routed_experts, replay=self._replay)
                    else:
                        logprobs, _ = token_logprobs(policy.model, mb.input_ids, mb.attention_mask, autocast=self._autocast,
                                                     sampling=_sampling(mb), shared_prefix=shared,
                                                     routing=mb.routed_experts, replay=self._replay)
                    if plan is not None:
                        pieces.append(logprobs.cpu())
        finally:
            policy.model.train()
            if policy.sharded:
                reshard(policy.model)  # a forward without backward leaves the root's parameters gathered
        if world == 1:
            return _unplanned(torch.cat(pieces), order)
        parts = self.ranks.gather(torch.cat(pieces) if pieces else None)  # type: ignore[union-attr]
        return None if parts is None else _unplanned(torch.cat([p for p in parts if p is not None]), order)

    # ------------------------------------------------------------ weights

    def gathered_state(self, bucket_bytes: int) -> dict[str, Tensor]:
        """A sharded policy's export tensors on rank 0's host, gathered one parameter at
        a time (`distributed.gather_buckets`); call it holding `lock`."""
        self._ready(None)
        return self._spmd("gather", bucket_bytes)

    def _do_gather(self, bucket_bytes: int) -> dict[str, Tensor]:
        policy = self._ready(None)
        return gather_state(policy.model, bucket_bytes, keep=self._rank_world()[0] == 0)

    def sharded_probe(self, token_ids: list[list[int]]) -> list[list[float]]:
        """A sharded policy's probe log-probs (`services.trainer.probe`): every rank runs the same
        eval forward (FSDP gathers layer by layer); call it holding `lock`."""
        self._ready(None)
        return self._spmd("probe", token_ids)

    def _do_probe(self, token_ids: list[list[int]]) -> list[list[float]]:
        policy = self._ready(None)
        policy.model.eval()
        try:
            return probe_logprobs(policy.model, token_ids, policy.device)
        finally:
            policy.model.train()
            reshard(policy.model)  # a forward without backward leaves the root's parameters gathered

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: Path | None = None, remove_previous: bool = False, client_state: bytes = b"") -> tuple[Path, int, int]:
        """Returns (path, step, size in bytes)."""
        with self._lock:
            policy = self._ready(None)
            if directory is not None:
                directory = confine(directory, request_roots(self.config), "directory")
            path, size = self._spmd("save", directory or self.config.checkpoint.dir, remove_previous, client_state)
            return path, policy.step, size

    def _do_save(self, parent: Path, remove_previous: bool, client_state: bytes) -> tuple[Path, int]:
        policy = self._ready(None)
        keep_last = self.config.checkpoint.keep_last
        if self.ranks is not None:
            return checkpoints.save_sharded(policy, parent, self.ranks, client_state=client_state,
                                            keep_last=keep_last, remove_previous=remove_previous)
        return checkpoints.save(policy, parent, client_state=client_state, keep_last=keep_last,
                                remove_previous=remove_previous)

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
                path = confine(path, request_roots(self.config), "path")
            step, version, client_state = self._spmd("load", path)
            return path, step, version, client_state

    def _do_load(self, path: Path) -> tuple[int, int, bytes]:
        return self._load_from(self._ready(None), path)

    def _load_from(self, policy: Policy, path: Path) -> tuple[int, int, bytes]:
        if self.ranks is not None:
            return checkpoints.load_sharded(policy, path, self.ranks)
        return checkpoints.load(policy, path)
