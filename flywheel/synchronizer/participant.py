"""The trainer's and rollouts' side of an NCCL/gloo transfer, driven through
the synchronizer: join the group it allocated, move the weights
(`flywheel.transfer.broadcast`), report the outcome, and apply the staged
weights only if the synchronizer declares the transfer COMMITTED.

    # trainer (rank 0)
    outcome = await broadcast_version(sync, "trainer-0", version, model.state_dict())
    # rollout, when NeedSync or Watch hands it a group
    outcome = await receive_version(sync, "rollout-0", group, live_weights)
    # rollout that swaps weights itself (the rollout service): staged only
    received = await stage_version(sync, "rollout-0", group, like)
    # rollout whose engine's worker process joins the group itself
    received = await stage_version(sync, "rollout-0", group, receiver=..., discard=...)

While the blocking broadcast runs in a worker thread, a watcher follows the
transfer on the synchronizer and raises the abort flag the broadcast polls,
so a transfer that failed elsewhere (a peer's error, an expired lease, the
deadline) stops this side at its next checkpoint instead of its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.codec import DEFAULT_BUCKET_BYTES
from flywheel.codec.identity import VersionIdentity, identify
from flywheel.errors import FailedPrecondition, FlywheelError
from flywheel.probe import ProbeBatch
from flywheel.transfer.broadcast import GroupSpec, apply_staged, receive, send
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import TransferOutcome
from flywheel.synchronizer.types import GroupInfo, State, TransferState


def spec_for(group: GroupInfo, component_id: str) -> GroupSpec:
    return GroupSpec(
        group_id=group.group_id, rendezvous_address=group.rendezvous_address, world_size=group.world_size,
        rank=group.rank_of(component_id), backend=group.backend, deadline=group.deadline_unix_ms / 1000,
        version=group.version,
    )


@contextlib.asynccontextmanager
async def _abort_flag(client: SynchronizerClient, group_id: str) -> AsyncIterator[threading.Event]:
    """A flag raised once the synchronizer no longer holds the transfer PENDING
    as anything but a success in the making (aborted, or unknown after a restart)."""
    aborted = threading.Event()

    async def follow() -> None:
        while True:
            try:
                outcome = await client.get_transfer(group_id, wait_seconds=5.0)
            except FlywheelError as exc:
                if exc.code == "NOT_FOUND":
                    aborted.set()
                    return
                await asyncio.sleep(0.5)  # the synchronizer is unreachable for now; keep going
                continue
            if outcome.state == TransferState.ABORTED:
                aborted.set()
            if outcome.state != TransferState.PENDING:
                return

    task = asyncio.ensure_future(follow())
    try:
        yield aborted
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _finish(
    client: SynchronizerClient, group: GroupInfo, component_id: str, error: BaseException | None,
    identity: VersionIdentity | None = None, probe: ProbeBatch | None = None,
) -> TransferOutcome:
    """Reports this side's outcome (the sender's with the identity, tensor digests and probe of what
    it sent) and waits for the transfer's."""
    reason = "" if error is None else f"{type(error).__name__}: {error}"
    sent = {"identity": identity or b"", "probe": probe} if error is None else {}
    await client.report_transfer(group.group_id, component_id, error is None, reason, **sent)
    wait = max(0.0, group.deadline_unix_ms / 1000 - time.time()) + 1.0
    return await client.get_transfer(group.group_id, wait_seconds=wait)


async def send_in_group(
    client: SynchronizerClient,
    trainer_id: str,
    group: GroupInfo,
    tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    on_bucket: Callable[[int], None] | None = None,
    identity: VersionIdentity | None = None,
    probe: ProbeBatch | Awaitable[ProbeBatch] | None = None,
) -> TransferOutcome:
    """Broadcasts `tensors` as rank 0. The version's identity with each tensor's digest
    (`identity`, or measured on `tensors` while the broadcast runs) and the trainer's `probe`
    of these weights (awaited after the broadcast: it may be computed meanwhile) go with the
    success report; the synchronizer records them with the version."""
    spec = spec_for(group, trainer_id)
    error: BaseException | None = None
    measured = None if identity is not None else asyncio.ensure_future(asyncio.to_thread(identify, tensors))
    async with _abort_flag(client, group.group_id) as aborted:
        try:
            await asyncio.to_thread(
                send, spec, tensors, bucket_bytes=bucket_bytes, should_abort=aborted.is_set, on_bucket=on_bucket
            )
            if measured is not None:
                identity = await measured
            if inspect.isawaitable(probe):
                probe = await probe
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the outcome decides
            error = exc
        finally:
            if measured is not None and not measured.done():
                measured.cancel()
    return await _finish(client, group, trainer_id, error, identity, None if inspect.isawaitable(probe) else probe)


async def broadcast_version(
    client: SynchronizerClient,
    trainer_id: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    rollout_ids: tuple[str, ...] = (),
    timeout_seconds: float = 0.0,
    backend: str = "",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    probe: ProbeBatch | None = None,
) -> TransferOutcome:
    """Trainer: allocates a group for `version` and broadcasts `tensors` as rank 0 (with its `probe`)."""
    try:
        group = await client.allocate_group(
            version, trainer_id, rollout_ids, timeout_seconds=timeout_seconds, backend=backend
        )
    except FlywheelError:
        # No transfer will end and release the trainer from WAITING_SYNC: do it here.
        with contextlib.suppress(FlywheelError):
            await client.set_state(trainer_id, State.RUNNING, expected=State.WAITING_SYNC)
        raise
    return await send_in_group(client, trainer_id, group, tensors, bucket_bytes=bucket_bytes, probe=probe)


@dataclass
class Received:
    """A receiver's side of one transfer, as `stage_version` leaves it."""

    #: The synchronizer's verdict (COMMITTED, ABORTED, or PENDING if it never came).
    outcome: TransferOutcome
    #: What the receive staged (the staged tensors, unless a `receiver` was given), set only when
    #: the transfer COMMITTED.
    staged: Any | None
    #: This side's own failure (already reported), kept so a caller can raise it
    #: with its own status (a wrong shape is INVALID_ARGUMENT, not ABORTED).
    error: BaseException | None


#: Receives this rank's share of a transfer somewhere else than this thread (e.g. in an inference
#: engine's worker process): (the rank's group spec, the abort flag to honour) -> what it staged.
#: It ends within the spec's deadline, and stops at once when cancelled or when the flag is raised.
Receiver = Callable[[GroupSpec, Callable[[], bool]], Awaitable[Any]]


async def _join(client: SynchronizerClient, rollout_id: str) -> None:
    """REQUIRE_SYNC -> WAITING_SYNC: the synchronizer knows this rollout is in a transfer."""
    try:
        await client.set_state(rollout_id, State.WAITING_SYNC)
    except FailedPrecondition:  # still RUNNING: ask first, then join
        await client.set_state(rollout_id, State.REQUIRE_SYNC)
        await client.set_state(rollout_id, State.WAITING_SYNC)


async def stage_version(
    client: SynchronizerClient,
    rollout_id: str,
    group: GroupInfo,
    like: Mapping[str, torch.Tensor] | None = None,
    *,
    on_bucket: Callable[[int], None] | None = None,
    receiver: Receiver | None = None,
    discard: Callable[[Any], Awaitable[None]] | None = None,
) -> Received:
    """Rollout: joins `group`, receives into fresh staging buffers shaped and
    placed like `like` (only its names, dtypes, shapes and device are read),
    reports, and waits for the outcome. Nothing live is touched.

    With `receiver`, that receives instead (`like` and `on_bucket` unused), and
    `discard` is handed what it staged if the transfer does not commit.

    Cancelled mid-receive (the caller's own deadline), it raises the abort
    flag the receiving thread polls and reports the failure before
    re-raising, so neither this thread nor the other ranks wait for the
    group's deadline.
    """
    if receiver is None:
        if like is None:
            raise ValueError("stage_version needs `like` or a `receiver`")

        def receiver(spec: GroupSpec, should_abort: Callable[[], bool]) -> Awaitable[dict[str, torch.Tensor]]:
            return asyncio.to_thread(receive, spec, like, should_abort=should_abort, on_bucket=on_bucket)

    await _join(client, rollout_id)
    spec = spec_for(group, rollout_id)
    staged: Any | None = None
    error: BaseException | None = None
    async with _abort_flag(client, group.group_id) as aborted:
        try:
            staged = await receiver(spec, aborted.is_set)
        except asyncio.CancelledError:
            aborted.set()
            with contextlib.suppress(FlywheelError):
                await asyncio.shield(client.report_transfer(group.group_id, rollout_id, False, "receiver cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the outcome decides
            error = exc
    try:
        outcome = await _finish(client, group, rollout_id, error)
    except BaseException:
        if staged is not None and discard is not None:
            await discard(staged)
        raise
    committed = outcome.state == TransferState.COMMITTED and staged is not None
    if not committed and staged is not None and discard is not None:
        await discard(staged)
    return Received(outcome, staged if committed else None, error)


async def receive_version(
    client: SynchronizerClient,
    rollout_id: str,
    group: GroupInfo,
    live: Mapping[str, torch.Tensor],
    *,
    apply: bool = True,
    on_bucket: Callable[[int], None] | None = None,
) -> tuple[TransferOutcome, dict[str, torch.Tensor] | None]:
    """Rollout: joins `group` (REQUIRE_SYNC -> WAITING_SYNC), receives into
    staging, reports, and on COMMITTED copies the staged weights into `live`
    (with apply) and returns them; otherwise returns None and `live` is untouched."""
    received = await stage_version(client, rollout_id, group, live, on_bucket=on_bucket)
    if received.staged is None:
        return received.outcome, None  # staged buffers are dropped: the old weights stay
    if apply:
        await asyncio.to_thread(apply_staged, received.staged, live)
    return received.outcome, received.staged
