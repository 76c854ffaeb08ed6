"""Weight broadcast over a fresh NCCL or gloo process group (one per transfer).

The synchronizer allocates the group (rendezvous "host:port", world size,
ranks, backend, deadline); the trainer is rank 0 and calls `send`, each
rollout process calls `receive`. Both are blocking (run them in a thread)
and bounded by the deadline in every step:

1. Rendezvous: rank 0 hosts a TCPStore on the port; everyone connects,
   announces itself, and waits until all ranks did, polling the store's
   `abort` key and the caller's `should_abort()` (the synchronizer's view)
   so a transfer aborted elsewhere ends here within ~20 ms.
2. A process group is built directly on that store (never the global
   default group, which an engine may own) with the deadline as timeout.
3. Tensors are packed into buckets (`flywheel.codec` bucket rules, 64-byte
   aligned offsets) and each bucket is one broadcast. On CPU each bucket's
   XXH3-64 goes through the store first and receivers verify it.
4. Receivers stage into fresh bucket buffers and return views of them; the
   caller applies them (`apply_staged`) only once the synchronizer says the
   transfer COMMITTED, so an aborted transfer leaves the live weights alone.
Any failure sets `abort` in the store, so peers stop waiting for this rank.
The same code runs nccl on GPUs and gloo on CPUs.

Backend "ipc" is for members that share one GPU (a co-located trainer and
rollout): no process group; rank 0 packs each bucket into one device buffer
it shares once per transfer (`flywheel.transfer.cuda_ipc`), and receivers
copy the bucket out of it, device to device, between two store barriers
(bucket ready, bucket copied) so the buffer is refilled only once every
receiver has its copy. The rendezvous, deadline, abort and verdict are the
same as for the other backends.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from flywheel.codec import DEFAULT_BUCKET_BYTES
from flywheel.codec.layout import assign_buckets
from flywheel.errors import Aborted, DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument
from flywheel.runtime.addresses import LOOPBACK_HOSTS
from flywheel.transfer.cuda_ipc import open_shared, require_cuda, share

ALIGN = 64
_POLL_SECONDS = 0.02
#: ipc's members share a host, and its per-bucket barriers wait for a device copy (milliseconds), not a
#: network: every wait of an ipc transfer polls this often (a 20 ms poll was most of a 47 ms handoff).
_IPC_POLL_SECONDS = 0.0005
BACKENDS = ("nccl", "gloo", "ipc")


@dataclass(frozen=True)
class GroupSpec:
    """One rank's view of a transfer group."""

    group_id: str
    rendezvous_address: str
    world_size: int
    rank: int
    backend: str
    #: Deadline of the whole transfer, in seconds since the Unix epoch.
    deadline: float
    version: int = 0

    def remaining(self, what: str) -> float:
        left = self.deadline - time.time()
        if left <= 0:
            raise DeadlineExceeded(f"transfer {self.group_id}: deadline passed during {what}")
        return left

    @property
    def host(self) -> str:
        return self.rendezvous_address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.rendezvous_address.rsplit(":", 1)[1])


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


def plan(metas: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> tuple[list[Slot], list[int]]:
    """Slots of every tensor and the byte size of every bucket."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in metas]
    buckets = assign_buckets([-(-n // ALIGN) * ALIGN for n in sizes], bucket_bytes)
    slots, fill = [], [0] * ((buckets[-1] + 1) if buckets else 0)
    for (name, dtype, shape), n, b in zip(metas, sizes, buckets):
        slots.append(Slot(name, dtype, shape, b, fill[b], n))
        fill[b] += -(-n // ALIGN) * ALIGN
    return slots, fill


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown dtype {name!r} in the transfer metadata")
    return dtype


class _Session:
    """Store rendezvous + process group of one rank; `close` tears both down."""

    def __init__(self, spec: GroupSpec, should_abort: Callable[[], bool] | None) -> None:
        self.spec, self._should_abort = spec, should_abort or (lambda: False)
        self.poll = _IPC_POLL_SECONDS if spec.backend == "ipc" else _POLL_SECONDS
        self.store = dist.PrefixStore(f"flywheel/{spec.group_id}/", self._connect())
        self.pg = None

    def _connect(self) -> dist.TCPStore:
        spec = self.spec
        if spec.rank != 0:
            self._await_listener()
        while True:
            self.check("rendezvous")
            wait = min(spec.remaining("rendezvous"), 2.0)
            try:
                # Rank 0 hands the store a socket of its own, bound to the advertised interface only:
                # a TCPStore left to bind itself listens on every interface.
                listener = _rendezvous_listener(spec) if spec.rank == 0 else None
                return dist.TCPStore(
                    spec.host, spec.port, spec.world_size, is_master=spec.rank == 0,
                    timeout=datetime.timedelta(seconds=wait), wait_for_workers=False,
                    master_listen_fd=listener,
                )
            except (OSError, RuntimeError, dist.DistStoreError) as exc:
                if spec.rank == 0:  # the port is taken or unbindable: nothing to wait for
                    raise FailedPrecondition(f"transfer {spec.group_id}: cannot host the rendezvous: {exc}") from None

    def _await_listener(self) -> None:
        """Polls rank 0's rendezvous port until it accepts a connection. A TCPStore client that finds
        nothing listening blocks for its whole timeout and then backs off for a second or more before
        it tries again: a receiver that arrived before the sender paid 2-4.5 s for that (measured with
        gloo on loopback), where the store is up milliseconds later."""
        spec = self.spec
        while True:
            self.check("rendezvous")
            try:
                with socket.create_connection((spec.host, spec.port), timeout=min(spec.remaining("rendezvous"), 1.0)):
                    return
            except OSError:
                time.sleep(self.poll)

    def check(self, what: str) -> None:
        if self._should_abort():
            raise Aborted(f"transfer {self.spec.group_id} was aborted (during {what})")

    def _peer_aborted(self) -> str | None:
        if self.store.check(["abort"]):
            return self.store.get("abort").decode(errors="replace")
        return None

    def barrier(self, name: str, limit: float | None = None) -> None:
        spec = self.spec
        self.store.set(f"{name}/{spec.rank}", "1")
        keys = [f"{name}/{r}" for r in range(spec.world_size)]
        end = time.time() + (limit if limit is not None else spec.remaining(name))
        while not self.store.check(keys):
            self.check(name)
            if (reason := self._peer_aborted()) is not None:
                raise Aborted(f"transfer {spec.group_id}: a peer aborted: {reason}")
            if time.time() > min(end, spec.deadline):
                raise DeadlineExceeded(f"transfer {spec.group_id}: not every rank reached {name!r} in time")
            time.sleep(self.poll)

    def join(self) -> None:
        self.barrier("joined")
        timeout = datetime.timedelta(seconds=self.spec.remaining("group setup"))
        if self.spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.spec.rank, self.spec.world_size, opts)
        elif self.spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            local = self.spec.host in LOOPBACK_HOSTS
            device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if local else (
                dist.ProcessGroupGloo.create_default_device()
            )
            opts._devices = [device]
            self.pg = dist.ProcessGroupGloo(self.store, self.spec.rank, self.spec.world_size, opts)
        elif self.spec.backend != "ipc":  # ipc moves buckets through shared device memory: no group
            raise InvalidArgument(f"unknown backend {self.spec.backend!r}; expected one of {BACKENDS}")

    def broadcast(self, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.pg.broadcast([buffer], opts)
        work.wait(datetime.timedelta(seconds=self.spec.remaining("broadcast")))

    def fail(self, reason: str) -> None:
        try:
            self.store.set("abort", f"rank {self.spec.rank}: {reason}"[:2000])
        except Exception:  # noqa: BLE001 - best effort: the store may be gone
            pass

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown") and self.spec.backend == "nccl":
            pg.shutdown()
        del pg
        # The last reference to the store: rank 0's rendezvous port closes now, not whenever this
        # session is collected (a traceback can keep it alive long after the transfer).
        self.store = None


def _rendezvous_listener(spec: GroupSpec) -> int:
    """A listening socket on the rendezvous address (its interface, not all of them), as a file
    descriptor the TCPStore takes over and closes with itself."""
    family, kind, proto, _, address = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(16, spec.world_size * 2))
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _run(spec: GroupSpec, device: torch.device, should_abort, body: Callable[[_Session], object]):
    if spec.backend == "ipc":
        require_cuda(device, f"transfer {spec.group_id}")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds its communicator to the current device
    session = _Session(spec, should_abort)
    try:
        session.join()
        return body(session)
    except BaseException as exc:
        session.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        session.close()


def send(
    spec: GroupSpec,
    tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    should_abort: Callable[[], bool] | None = None,
    on_bucket: Callable[[int], None] | None = None,
) -> int:
    """Rank 0: broadcasts `tensors` (in their order); returns the bytes sent."""
    if spec.rank != 0:
        raise InvalidArgument(f"send is for rank 0, this is rank {spec.rank}")
    metas = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    slots, sizes = plan(metas, bucket_bytes)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if spec.backend in ("nccl", "ipc") and device.type != "cuda" and torch.cuda.is_available():
        # Host tensors (a sharded trainer's export, gathered into host memory) go through a
        # bucket on this process's GPU: one bucket of device memory, not a model's worth.
        device = torch.device("cuda", torch.cuda.current_device())
    checksum = device.type == "cpu"

    def body(session: _Session) -> int:
        ipc = spec.backend == "ipc"
        buffer = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device)
        meta = {"bucket_bytes": bucket_bytes, "checksums": checksum,
                "tensors": [[n, str(d), list(s)] for n, d, s in metas]}
        if ipc:
            meta["ipc"] = share(buffer) if buffer.numel() else None
        session.store.set("meta", json.dumps(meta))
        for b, size in enumerate(sizes):
            view = buffer[:size]
            for slot in (s for s in slots if s.bucket == b and s.nbytes):
                src = tensors[slot.name].detach().contiguous().reshape(-1).view(torch.uint8)
                view[slot.offset : slot.offset + slot.nbytes].copy_(src)
            if checksum:
                session.store.set(f"sum/{b}", str(xxhash.xxh3_64_intdigest(view.numpy())))
            session.check(f"bucket {b}")
            if ipc:
                torch.cuda.current_stream(device).synchronize()  # the bucket is in memory before anyone reads it
                session.barrier(f"ready/{b}")
                session.barrier(f"copied/{b}")  # refilled only once everyone copied it
            else:
                session.broadcast(view)
            if on_bucket is not None:
                on_bucket(b)
        # Receivers read bucket checksums from the store this rank hosts:
        # keep it up until each is done (or someone aborted).
        session.barrier("done", limit=min(spec.remaining("completion"), 60.0))
        return sum(sizes)

    return _run(spec, device, should_abort, body)


def receive(
    spec: GroupSpec,
    like: Mapping[str, torch.Tensor],
    *,
    should_abort: Callable[[], bool] | None = None,
    on_bucket: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """A receiver: stages the broadcast into fresh buffers on `like`'s device.

    `like` gives the names, dtypes and shapes this rank expects (its live
    weights); a mismatch fails before any bucket moves. Returns staged
    tensors (views into the bucket buffers) to `apply_staged` on commit.
    """
    if spec.rank == 0:
        raise InvalidArgument("receive is for ranks >= 1; rank 0 sends")
    device = next(iter(like.values())).device if like else torch.device("cpu")

    def body(session: _Session) -> dict[str, torch.Tensor]:
        meta = json.loads(session.store.get("meta"))
        metas = [(n, _dtype(d), tuple(s)) for n, d, s in meta["tensors"]]
        _check_like(metas, like)
        slots, sizes = plan(metas, int(meta["bucket_bytes"]))
        shared = open_shared(meta["ipc"], device) if spec.backend == "ipc" and meta.get("ipc") else None
        staged: dict[str, torch.Tensor] = {}
        for b, size in enumerate(sizes):
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            session.check(f"bucket {b}")
            if spec.backend == "ipc":
                session.barrier(f"ready/{b}")
                buffer.copy_(shared[:size])
                torch.cuda.current_stream(device).synchronize()
                session.barrier(f"copied/{b}")
            else:
                session.broadcast(buffer)
            if meta["checksums"] and device.type == "cpu":
                want = int(session.store.get(f"sum/{b}"))
                if xxhash.xxh3_64_intdigest(buffer.numpy()) != want:
                    raise DataLoss(f"transfer {spec.group_id}: bucket {b} arrived corrupt (checksum mismatch)")
            for slot in (s for s in slots if s.bucket == b):
                raw = buffer[slot.offset : slot.offset + slot.nbytes]
                staged[slot.name] = raw.view(slot.dtype).view(slot.shape) if slot.nbytes else torch.empty(
                    slot.shape, dtype=slot.dtype, device=device
                )
            if on_bucket is not None:
                on_bucket(b)
        shared = None  # unmapped before rank 0, which owns the buffer, is told it may go
        session.store.set(f"done/{spec.rank}", "1")  # rank 0 may close the store now
        return staged

    return _run(spec, device, should_abort, body)


def placeholders(specs: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """A `like` for `receive` from specs (anything with .dtype and .shape): stride-0 views of one
    element each. `receive` reads only names, dtypes, shapes and the device from `like`, and
    full-size empties would cost a second copy of the model's memory for nothing."""
    return {name: torch.empty((), dtype=s.dtype, device=device).expand(tuple(s.shape)) for name, s in specs.items()}


def _check_like(metas: list[tuple[str, torch.dtype, tuple[int, ...]]], like: Mapping[str, torch.Tensor]) -> None:
    sent = {n: (d, s) for n, d, s in metas}
    missing, extra = sorted(set(like) - set(sent))[:5], sorted(set(sent) - set(like))[:5]
    if missing or extra:
        raise InvalidArgument(
            f"the broadcast does not match this rank's weights: missing {missing}, unexpected {extra}"
        )
    for name, (dtype, shape) in sent.items():
        t = like[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise InvalidArgument(
                f"tensor {name!r}: broadcast {dtype}{list(shape)}, this rank holds {t.dtype}{list(t.shape)}"
            )


def apply_staged(staged: Mapping[str, torch.Tensor], destination: Mapping[str, torch.Tensor]) -> None:
    """Copies a committed transfer's staged tensors into the live weights."""
    with torch.no_grad():
        for name, tensor in staged.items():
            destination[name].copy_(tensor)
