"""NCCL/gloo weight updates: receive a broadcast in the synchronizer's group,
swap only once the synchronizer declares the transfer COMMITTED.

The controller allocates a group with the synchronizer, then runs the
trainer's export (rank 0, `flywheel.transfer.broadcast.send`) and every
replica's `UpdateWeights(nccl=...)` together. On this side:

1. The group is read back from the synchronizer named in the request: it is
   the source of truth (deadline, members), and the member holding the
   request's rank is this replica's component id there, so the request needs
   no second name for it. Fields the request repeats must agree with it.
2. Staging (`flywheel.synchronizer.participant.stage_version`) joins the
   group and receives into fresh bucket buffers shaped by the engine's
   `weight_specs()`; names, dtypes and shapes are checked before any bucket
   moves (INVALID_ARGUMENT), gloo buckets are checksummed on CPU (DATA_LOSS).
   This side's outcome is reported, then the synchronizer's verdict awaited:
   only COMMITTED (every receiver confirmed) hands the staged weights to the
   update transaction's swap under generation's gate.
3. Any failure, abort or timeout before the swap leaves the engine on its old
   weights, untouched, and is reported to the synchronizer (a late report
   after the verdict changes nothing there), so the trainer and the other
   replicas stop at once instead of at the group's deadline.

Who receives: an engine that joins groups itself (`Engine.joins_groups`: the
vLLM engine, whose worker process holds the served model) is handed the
group and receives there, on the worker's device, with the same code and
checks (`receive_in_group`); the buckets never pass through this process.
Otherwise this process receives, in a thread: gloo on CPU, nccl on its
current CUDA device with the staged tensors copied to CPU after the commit
(the engine contract is CPU tensors). nccl without CUDA where the receive
runs is FAILED_PRECONDITION.

The staging deadline is the later of the update's timeout and the group's
deadline (plus the wait for the verdict): every rank gives up at the group's
deadline anyway, and stopping this side earlier could leave it having
confirmed a transfer that then commits without being swapped in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.codec.identity import VersionIdentity
from flywheel.errors import Aborted, DeadlineExceeded, FailedPrecondition, FlywheelError, InvalidArgument, NotFound
from services.rollout.engine.base import Engine, PauseMode, StagedWeights, TensorSpec
from services.rollout.weights.transaction import ProofSource, UpdateResult, WeightUpdates
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.participant import Received, stage_version
from flywheel.synchronizer.types import GroupInfo, TransferState
from flywheel.transfer.broadcast import BACKENDS, placeholders

#: Deadline of each plain synchronizer call (state changes, reports), in seconds.
RPC_SECONDS = 10.0
#: Past the group's deadline: the verdict wait (deadline + 1 s) and its call deadline.
_VERDICT_MARGIN_SECONDS = 1.0 + RPC_SECONDS + 5.0


@dataclass(frozen=True)
class NcclTarget:
    """The group an UpdateWeights(nccl) names, as the controller saw it."""

    group_id: str
    synchronizer_address: str
    rank: int
    #: Optional repeats of the synchronizer's group (empty/0: not checked).
    rendezvous_address: str = ""
    world_size: int = 0
    backend: str = ""


def receive_device(backend: str) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if backend in ("nccl", "ipc"):
        if not torch.cuda.is_available():
            raise FailedPrecondition(
                f"the transfer group uses backend {backend}, but this rollout process has no CUDA device; "
                "allocate the group with backend gloo"
            )
        return torch.device("cuda", torch.cuda.current_device())
    raise InvalidArgument(f"unknown backend {backend!r} in the transfer group; expected one of {BACKENDS}")


def member_of(group: GroupInfo, rank: int) -> str:
    """This replica's component id in `group`: the member holding its rank."""
    if rank < 1:
        raise InvalidArgument("nccl.rank: rank 0 is the trainer's; a rollout receives as rank >= 1")
    ids = [cid for cid, r in group.ranks.items() if r == rank]
    if not ids:
        raise InvalidArgument(f"nccl.rank: transfer group {group.group_id!r} has no member of rank {rank}")
    return ids[0]


def check_agrees(group: GroupInfo, target: NcclTarget, version: int) -> None:
    """The request's repeats of the group, and its version, match the synchronizer's."""
    for field, asked, actual in (
        ("nccl.rendezvous_address", target.rendezvous_address, group.rendezvous_address),
        ("nccl.world_size", target.world_size, group.world_size),
        ("nccl.backend", target.backend, group.backend),
    ):
        if asked and asked != actual:
            raise InvalidArgument(f"{field}: {asked!r}, but the synchronizer's group {group.group_id!r} has {actual!r}")
    if version != group.version:
        raise InvalidArgument(f"version: {version}, but transfer group {group.group_id!r} carries version {group.version}")


async def _group(client: SynchronizerClient, target: NcclTarget) -> GroupInfo:
    outcome = await client.get_transfer(target.group_id)
    if outcome.group is None:
        raise NotFound(f"nccl.group_id: the synchronizer knows no transfer group {target.group_id!r}")
    if outcome.state != TransferState.PENDING:
        raise FailedPrecondition(
            f"transfer {target.group_id} already ended {outcome.state.name}: {outcome.error or 'no reason given'}"
        )
    return outcome.group


async def _stage(
    client: SynchronizerClient, member: str, group: GroupInfo, specs: dict[str, TensorSpec], device: torch.device
) -> StagedWeights:
    """This process receives: into CPU tensors (copied off the GPU after the commit, for nccl)."""
    received = await stage_version(client, member, group, placeholders(specs, device))
    staged = _committed(received, group)
    tensors = staged
    if device.type != "cpu":
        tensors = await asyncio.to_thread(lambda: {n: t.to("cpu") for n, t in staged.items()})
    return StagedWeights(version=group.version, tensors=tensors, nbytes=sum(t.nbytes for t in tensors.values()),
                         identity=_identity(received))


def _identity(received: Received) -> VersionIdentity | None:
    """What the sender said it sent (its confirmation carries it; the version is committed with it)."""
    return VersionIdentity(received.outcome.identity) if received.outcome.identity else None


async def _stage_in_engine(client: SynchronizerClient, member: str, group: GroupInfo, engine: Engine) -> StagedWeights:
    """The engine receives, in its own process (its worker: the tensors land where they are served)."""
    received = await stage_version(client, member, group, receiver=engine.receive_in_group,
                                   discard=engine.discard_weights)
    staged = _committed(received, group)
    staged.identity = _identity(received)
    return staged


def _committed(received: Received, group: GroupInfo) -> Any:
    """What was staged, once the synchronizer declared the transfer COMMITTED; else its error."""
    if received.error is not None:
        if isinstance(received.error, FlywheelError):
            raise received.error  # keeps its status: a wrong shape is INVALID_ARGUMENT, corrupt bytes DATA_LOSS
        raise Aborted(f"transfer {group.group_id} failed on this rank: {received.error}") from received.error
    outcome = received.outcome
    if received.staged is None:
        error = DeadlineExceeded if outcome.state == TransferState.PENDING else Aborted
        raise error(f"transfer {group.group_id} of version {group.version} ended "
                    f"{outcome.state.name}: {outcome.error or 'no verdict by the deadline'}")
    return received.staged


async def update_over_group(
    updates: WeightUpdates, target: NcclTarget, version: int, mode: PauseMode | None, timeout: float, *,
    token: str | None, rewind: bool = False, proof: ProofSource | None = None,
) -> UpdateResult:
    """Receives `version` in the target's group and swaps it in on commit (see module doc);
    `rewind`: in place of a lost lineage's weights, whatever their number (`WeightUpdates.run`);
    `proof`: the synchronizer's record of the version, asked for once the transfer committed."""
    engine, _ = updates.core.require_engine()
    async with SynchronizerClient(target.synchronizer_address, token, timeout=RPC_SECONDS) as client:
        group = await _group(client, target)
        member = member_of(group, target.rank)
        try:
            check_agrees(group, target, version)
            if engine.joins_groups:
                stage = lambda: _stage_in_engine(client, member, group, engine)  # noqa: E731
            else:
                device = receive_device(group.backend)
                specs = dict(engine.weight_specs())
                stage = lambda: _stage(client, member, group, specs, device)  # noqa: E731
            left = group.deadline_unix_ms / 1000 - time.time() + _VERDICT_MARGIN_SECONDS
            return await updates.run(version, stage, mode, max(timeout, left), rewind=rewind, proof=proof)
        except BaseException as exc:
            # Also for failures before the receive started (a stale version, no
            # CUDA): the other ranks then stop now rather than at the deadline.
            with contextlib.suppress(FlywheelError):
                reason = f"{type(exc).__name__}: {exc}"
                await asyncio.shield(client.report_transfer(group.group_id, member, False, reason))
            raise
