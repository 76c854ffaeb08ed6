"""Trajectories -> the tensors of the trainer's TrainBatch.

Each row is prompt + response token ids, right-padded to the longest row.
Tensors follow the trainer's contract (trainer.proto `TrainBatch`):
- input_ids, attention_mask: int64 [B, T];
- loss_mask: float32 [B, T], 1 on response tokens the policy produced
  (tool/environment tokens and the prompt are 0);
- behaviour_logprobs: float32 [B, T], the sampling engine's log-prob of the
  token *at* each position (0 elsewhere);
- advantages: float32 [B] (one per sequence), or [B, T] when a trajectory carries
  its own per token (on-policy distillation: `advantages_tensor`);
- weight_versions: int64 [B, T], the version that produced the token at each
  response position (0 elsewhere), from the trajectories' version spans: a
  sample made across weight updates is not trained as if one policy made it;
- sampling_temperature / sampling_top_k / sampling_top_p: [B], the distribution
  each sample was drawn from (the sampling contract), sent when any is not raw;
- sampler_kept_size int32 [B, T] / sampler_kept_ids int32 [B, T, M]: the
  sampler's own kept set at each position where the rollout recorded one
  (flywheel.common.kept), sent when any was; a *constrained* position whose
  allowed set was too big to carry is masked out of the loss instead (its
  ratio cannot be taken over the right support) and counted
  (`sampler_counts`);
- routed_experts [B, T, L, K]: a mixture-of-experts model's recorded routing
  (flywheel.models.moe's compact dtype, "none" where a row has no record),
  sent when any trajectory has one.

The token staleness bound (`TokenBound`) is enforced here, where samples are
consumed: a policy token whose age (the batch's version minus its own) is
over the bound is masked out of the loss, or, when the run corrects, kept for
the trainer's truncated importance-sampling correction; its neighbours in the
same sample train either way. The batch says what it did (`token_ages`,
`stale_tokens`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.controller.domain import Trajectory


@dataclass(frozen=True)
class TokenBound:
    """The most versions a trained token may lag the batch it is trained in, and what happens to one
    that lags more: masked out of the loss, or (`correct`) trained with the trainer's IS correction."""

    #: In versions; None: no bound (batches built outside a run).
    limit: int | None = None
    correct: bool = False


UNBOUNDED = TokenBound()


@dataclass
class TrainBatch:
    tensors: dict[str, torch.Tensor]
    trajectories: list[Trajectory]
    #: Trainer weight version this batch is trained at.
    target_version: int
    #: Per-group notes from the processor (staleness etc.), for metrics.
    info: dict[str, float] = field(default_factory=dict)
    #: Age (target_version - the token's version) -> policy tokens of that age the loss reads.
    token_ages: Counter[int] = field(default_factory=Counter)
    #: Policy tokens past the bound: masked out of the loss, or (`stale_corrected`) trained corrected.
    stale_tokens: int = 0
    stale_corrected: bool = False
    #: The sampler's kept sets in the batch's policy tokens: "kept_ids" (carried as ids), "kept_size_only"
    #: (too big: its size alone), "constrained" (a grammar's), "constrained_excluded" (a grammar's, too big to
    #: carry: masked out of the loss).
    sampler_counts: Counter[str] = field(default_factory=Counter)

    @property
    def size(self) -> int:
        return len(self.trajectories)

    @property
    def tokens(self) -> int:
        return int(self.tensors["attention_mask"].sum())

    def staleness(self) -> list[int]:
        return [self.target_version - t.version for t in self.trajectories]


def build_train_batch(trajectories: Sequence[Trajectory], target_version: int, pad_id: int = 0,
                      bound: TokenBound = UNBOUNDED) -> TrainBatch:
    if not trajectories:
        raise ValueError("cannot build an empty batch")
    b = len(trajectories)
    t_max = max(t.num_tokens for t in trajectories)
    # Filled as numpy rows, converted once: per-row torch indexing costs more
    # than the whole batch at these sizes, and this runs on the event loop.
    input_ids = np.full((b, t_max), pad_id, dtype=np.int64)
    attention = np.zeros((b, t_max), dtype=np.int64)
    loss_mask = np.zeros((b, t_max), dtype=np.float32)
    logprobs = np.zeros((b, t_max), dtype=np.float32)
    versions = np.zeros((b, t_max), dtype=np.int64)
    for row, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if p == 0:
            raise ValueError(f"trajectory of task {t.task.id} has an empty prompt")
        if not (len(t.response_logprobs) == len(t.response_mask) == r):
            raise ValueError(f"trajectory of task {t.task.id}: response ids, log-probs and mask differ in length")
        input_ids[row, :p] = t.prompt_ids
        input_ids[row, p : p + r] = t.response_ids
        attention[row, : p + r] = 1
        loss_mask[row, p : p + r] = t.response_mask
        logprobs[row, p : p + r] = t.response_logprobs
        versions[row, p : p + r] = t.token_versions()
    kept, counts = kept_set_tensors(trajectories, loss_mask)
    policy_tokens = loss_mask > 0
    ages = np.where(policy_tokens, target_version - versions, 0)
    stale = policy_tokens & (ages > bound.limit) if bound.limit is not None else np.zeros_like(policy_tokens)
    if not bound.correct:
        loss_mask[stale] = 0.0
    logprobs *= loss_mask  # behaviour log-probs only where the loss reads them
    trained = loss_mask > 0
    tensors = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss_mask),
        "advantages": advantages_tensor(trajectories, t_max),
        "behaviour_logprobs": torch.from_numpy(logprobs),
        "weight_versions": torch.from_numpy(np.where(policy_tokens, versions, 0)),
    }
    tensors.update(sampling_tensors(trajectories))
    tensors.update(kept)
    if (routed := routing_tensor(trajectories, t_max)) is not None:
        tensors["routed_experts"] = routed
    ages_trained = Counter({int(age): int(n) for age, n in zip(*np.unique(ages[trained], return_counts=True))})
    return TrainBatch(tensors=tensors, trajectories=list(trajectories), target_version=target_version,
                      token_ages=ages_trained, stale_tokens=int(stale.sum()), stale_corrected=bound.correct,
                      sampler_counts=counts)


def advantages_tensor(trajectories: Sequence[Trajectory], t_max: int) -> torch.Tensor:
    """[B] one advantage per sequence; [B, T] when a trajectory has its own per token (distillation), the
    others' broadcast over their response tokens."""
    if all(t.token_advantages is None for t in trajectories):
        return torch.tensor([t.advantage or 0.0 for t in trajectories], dtype=torch.float32)
    out = np.zeros((len(trajectories), t_max), dtype=np.float32)
    for row, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if t.token_advantages is None:
            out[row, p:p + r] = t.advantage or 0.0
        elif len(t.token_advantages) != r:
            raise ValueError(f"trajectory of task {t.task.id}: {len(t.token_advantages)} token advantages for "
                             f"{r} response tokens")
        else:
            out[row, p:p + r] = t.token_advantages
    return torch.from_numpy(out)


def stale_everywhere(group: Sequence[Trajectory], batch_version: int, bound: TokenBound) -> bool:
    """Whether every policy token of `group` is past the bound at `batch_version` and would be masked:
    such a group would train nothing (and a batch of nothing else is one the trainer refuses)."""
    if bound.limit is None or bound.correct:
        return False
    policy_tokens = 0
    for t in group:
        for version, mask in zip(t.token_versions(), t.response_mask):
            if mask:
                policy_tokens += 1
                if batch_version - version <= bound.limit:
                    return False
    return policy_tokens > 0


def sampling_tensors(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
    """The distributions the trainer replays, [B] each; none when every sample's log-probs are raw."""
    for t in trajectories:
        if t.distribution.penalised:
            raise ValueError(f"trajectory of task {t.task.id} was sampled with a repetition penalty or min_tokens, "
                             "which the trainer does not replay")
    if all(t.distribution.raw for t in trajectories):
        return {}
    return {
        "sampling_temperature": torch.tensor([t.distribution.temperature for t in trajectories], dtype=torch.float32),
        "sampling_top_k": torch.tensor([t.distribution.top_k for t in trajectories], dtype=torch.int64),
        "sampling_top_p": torch.tensor([t.distribution.top_p for t in trajectories], dtype=torch.float32),
    }


def kept_set_tensors(trajectories: Sequence[Trajectory], loss_mask: np.ndarray
                     ) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """sampler_kept_size / sampler_kept_ids of the policy tokens (none when no trajectory recorded a set),
    and what they hold. Masks out of `loss_mask`, in place, the constrained tokens whose allowed set was too
    big to carry."""
    counts: Counter[str] = Counter()
    if not any(t.kept_sets for t in trajectories):
        return {}, counts
    b, t_max = loss_mask.shape
    width = max((len(k.token_ids) for t in trajectories for k in t.kept_sets), default=0)
    size = np.zeros((b, t_max), dtype=np.int32)
    ids = np.full((b, t_max, max(width, 1)), -1, dtype=np.int32)
    for row, t in enumerate(trajectories):
        p = len(t.prompt_ids)
        for k in t.kept_sets:
            at = p + k.position
            if not 0 <= k.position < len(t.response_ids) or loss_mask[row, at] <= 0:
                continue  # not a policy token (or already masked): the loss does not read it
            if k.constrained and not k.carried:
                loss_mask[row, at] = 0.0
                counts["constrained_excluded"] += 1
                continue
            counts["constrained"] += k.constrained
            counts["kept_ids" if k.carried else "kept_size_only"] += 1
            size[row, at] = k.size
            ids[row, at, :len(k.token_ids)] = k.token_ids
    out = {"sampler_kept_size": torch.from_numpy(size)}
    if width:
        out["sampler_kept_ids"] = torch.from_numpy(ids)
    return out, counts


def routing_tensor(trajectories: Sequence[Trajectory], t_max: int) -> torch.Tensor | None:
    """routed_experts [B, T, L, K] when any trajectory recorded its routing; rows or positions without a
    record hold "none" (255 as uint8, -1 as int16): the trainer routes those itself."""
    recorded = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    if not recorded:
        return None
    shape = recorded[0].shape[1:]
    if any(r.shape[1:] != shape for r in recorded):
        raise ValueError(f"trajectories record routing of different shapes: {sorted({r.shape[1:] for r in recorded})}")
    dtype = np.uint8 if all(r.dtype == np.uint8 for r in recorded) else np.int16
    out = np.full((len(trajectories), t_max, *shape), 255 if dtype == np.uint8 else -1, dtype=dtype)
    for row, t in enumerate(trajectories):
        if t.routed_experts is None:
            continue
        r = t.routed_experts
        if r.shape[0] > t.num_tokens:
            raise ValueError(f"trajectory of task {t.task.id}: routing of {r.shape[0]} positions for "
                             f"{t.num_tokens} tokens")
        out[row, :r.shape[0]] = r if dtype == np.uint8 else np.where(r == 255, -1, r) if r.dtype == np.uint8 else r
    return torch.from_numpy(out)
