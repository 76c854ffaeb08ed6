"""NCCL method: process groups for weight transfers, and their outcome.

One group per transfer, never reused: `allocate` picks a rendezvous port,
ranks (trainer 0, then one per rollout), a backend and a deadline. Each
participant joins (see `flywheel.transfer.broadcast`), then reports success
or failure. The transfer is COMMITTED once every receiver confirmed; it is
ABORTED when anyone reports a failure, a member leaves (lease expiry,
deregistration, re-registration), the deadline passes, or the trainer
allocates a newer group. Either way `on_finish` runs once, so the service
moves members back to RUNNING and records the version only on commit. The
next sync allocates a fresh group, so replicas may join or leave in between.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from flywheel.probe import ProbeBatch
from services.synchronizer.buffers import Signal
from flywheel.synchronizer.types import Component, TransferState
from flywheel.transfer.broadcast import BACKENDS
from flywheel.transfer.cuda_ipc import GPU_LABEL



@dataclass
class Group:
    group_id: str
    version: int
    rendezvous_address: str
    world_size: int
    backend: str
    #: (component id, rank); rank 0 is the trainer.
    members: list[tuple[str, int]]
    deadline_unix_ms: int
    deadline: float  # monotonic
    state: TransferState = TransferState.PENDING
    error: str = ""
    confirmed: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    #: What rank 0 reported it sent (flywheel.codec.identity); the version's identity once committed.
    identity: bytes = b""
    #: Rank 0's tensor digests (composing to `identity`) and probe, recorded with the version on commit.
    tensors: dict[str, bytes] = field(default_factory=dict)
    probe: ProbeBatch | None = None

    @property
    def trainer_id(self) -> str:
        return self.members[0][0]

    @property
    def receivers(self) -> list[str]:
        return [cid for cid, rank in self.members if rank > 0]

    def has(self, component_id: str) -> bool:
        return any(cid == component_id for cid, _ in self.members)

    @property
    def port(self) -> int:
        return int(self.rendezvous_address.rsplit(":", 1)[1])


class Transfers:
    def __init__(
        self,
        *,
        host: str,
        ports: range,
        default_timeout: float,
        default_backend: str,
        on_finish: Callable[[Group], None],
        keep_finished: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host, self.ports = host, ports
        self.default_timeout, self.default_backend = default_timeout, default_backend
        self._on_finish = on_finish
        self._keep_finished = keep_finished
        self._clock = clock
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self._next_port = 0
        self._changed = Signal()

    def pending(self) -> list[Group]:
        return [g for g in self.groups.values() if g.state == TransferState.PENDING]

    def pending_for(self, component_id: str) -> Group | None:
        return next((g for g in self.pending() if g.has(component_id)), None)

    def _port(self) -> int:
        busy = {g.port for g in self.pending()}
        for _ in range(len(self.ports)):
            port = self.ports[self._next_port % len(self.ports)]
            self._next_port += 1
            if port not in busy:
                return port
        raise ResourceExhausted(f"every rendezvous port in [{self.ports.start}, {self.ports.stop}) is in use")

    def _backend(self, requested: str, members: Sequence[Component]) -> str:
        backend = requested or self.default_backend
        if backend == "auto":
            on_cuda = all(m.identity.labels.get("device", "").startswith("cuda") for m in members)
            gpus = {m.identity.labels.get(GPU_LABEL, "") for m in members}
            # Everyone on one GPU (co-located): NCCL refuses two ranks on one device; ipc copies in place.
            backend = ("ipc" if len(gpus) == 1 and "" not in gpus else "nccl") if on_cuda else "gloo"
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend must be one of {BACKENDS} (or empty for the default), got {backend!r}")
        return backend

    def _host(self, trainer: Component) -> str:
        if self.host:
            return self.host
        host = trainer.identity.address.rsplit(":", 1)[0] if ":" in trainer.identity.address else ""
        return host.strip("[]") if host and host not in ("0.0.0.0", "[::]", "::") else "127.0.0.1"

    def allocate(
        self, version: int, trainer: Component, rollouts: Sequence[Component], timeout: float, backend: str
    ) -> Group:
        if not rollouts:
            raise FailedPrecondition("no rollout to receive: a transfer needs at least one running rollout")
        timeout = timeout or self.default_timeout
        if timeout <= 0:
            raise InvalidArgument(f"timeout_seconds must be positive, got {timeout}")
        members = [trainer, *rollouts]
        chosen = self._backend(backend, members)
        # A member can be in one transfer at a time: a new group supersedes
        # the pending ones of its members (torn down, rebuilt here).
        for g in self.pending():
            if any(g.has(m.id) for m in members):
                self._finish(g, TransferState.ABORTED, f"superseded by a new group for version {version}")
        now = self._clock()
        group = Group(
            group_id=f"v{version}-{uuid.uuid4().hex[:10]}",
            version=version,
            rendezvous_address=f"{self._host(trainer)}:{self._port()}",
            world_size=len(members),
            backend=chosen,
            members=[(m.id, rank) for rank, m in enumerate(members)],
            deadline_unix_ms=int((time.time() + timeout) * 1000),
            deadline=now + timeout,
            started=now,
        )
        self.groups[group.group_id] = group
        self._trim()
        return group

    def get(self, group_id: str) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            raise NotFound(f"transfer group {group_id!r} is unknown (finished long ago, or before a restart)")
        return group

    def report(self, group_id: str, component_id: str, success: bool, error: str = "", identity: bytes = b"",
               tensors: dict[str, bytes] | None = None, probe: ProbeBatch | None = None) -> Group:
        """A member's outcome. The transfer commits once every member confirmed, the sender
        included: its confirmation carries the identity of what it sent (with each tensor's
        digest and its probe), which the version is committed with and the receivers verify
        their loaded weights against."""
        group = self.get(group_id)
        if not group.has(component_id):
            raise FailedPrecondition(f"{component_id!r} is not a member of transfer group {group_id!r}")
        if group.state != TransferState.PENDING:
            return group  # late reports change nothing; the outcome is final
        if not success:
            self._finish(group, TransferState.ABORTED, f"{component_id} failed: {error or 'no reason given'}")
        else:
            if component_id == group.trainer_id and identity:
                group.identity, group.tensors, group.probe = identity, dict(tensors or {}), probe
            group.confirmed.add(component_id)
            if all(cid in group.confirmed for cid, _ in group.members):
                self._finish(group, TransferState.COMMITTED, "")
        return group

    def member_left(self, component_id: str, reason: str) -> list[Group]:
        """Aborts every pending transfer the component is in."""
        hit = [g for g in self.pending() if g.has(component_id)]
        for group in hit:
            self._finish(group, TransferState.ABORTED, f"{component_id} left: {reason}")
        return hit

    def sweep(self) -> list[Group]:
        """Aborts transfers past their deadline."""
        now = self._clock()
        late = [g for g in self.pending() if g.deadline < now]
        for group in late:
            missing = [m for m in group.receivers if m not in group.confirmed]
            self._finish(group, TransferState.ABORTED, f"deadline passed; no confirmation from {missing}")
        return late

    async def wait(self, group_id: str, timeout: float) -> Group:
        """The group once it is no longer PENDING, or as it is after `timeout` seconds."""
        deadline = self._clock() + max(0.0, timeout)
        group = self.get(group_id)
        while group.state == TransferState.PENDING and (left := deadline - self._clock()) > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return group

    def _finish(self, group: Group, state: TransferState, error: str) -> None:
        group.state, group.error = state, error
        self._changed.fire()
        self._on_finish(group)

    def _trim(self) -> None:
        finished = [g for g in self.groups.values() if g.state != TransferState.PENDING]
        for group in finished[: max(0, len(finished) - self._keep_finished)]:
            del self.groups[group.group_id]
