"""How rollouts and training keep pace: the `pool`, `staleness` and `sync` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flywheel.common.types import PauseMode
from flywheel.synchronizer.types import SyncMethodName, SyncStyleName
from flywheel.runtime.config import StrictModel


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
