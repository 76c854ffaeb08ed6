"""Flywheel's weight-transfer engine for vLLM ("flywheel"), run in vLLM's worker.

vLLM's weight-transfer framework (`vllm.distributed.weight_transfer`) creates
one engine per worker from `weight_transfer_config.backend`, and its
`update_weights` API hands that engine an update info. This engine takes
weights from three places, and verifies everything before it loads the first
parameter, so a rejected update leaves the model untouched:

* the synchronizer's NCCL/gloo transfer group (`group`): it joins the group
  as the replica's rank and receives the broadcast on the worker's device
  (`flywheel.transfer.broadcast.receive`: names, dtypes and shapes checked
  before any bucket moves, gloo buckets checksummed). `stage` does that in
  the background; the service reports to the synchronizer and loads the
  version by its ticket only once the transfer COMMITTED, else drops it;
* the synchronizer (MEMORY): it pulls the version itself, through
  `flywheel.synchronizer.pull` (payloads read in place from the synchronizer's
  shared-memory segments when it is on this host, else from the stream),
  checking every chunk's checksum, the version's digest, and names, dtypes and
  shapes against the served checkpoint. `stage` does that in the background
  while generation goes on, and the update names the staged version by its
  ticket; an update info naming a synchronizer and a version pulls and loads in
  one call instead;
* memory the rollout service shares (tensors it received and verified, in an
  anonymous memory file of its process: `shared`);
* safetensors files of a checkpoint directory the service verified (`files`).

The load, and what it measures, is `vllm_load`'s. No weight file is ever written.

Why an engine of ours: vLLM's own engines (nccl, ipc, sparse) are CUDA-only,
and none reads the synchronizer's checksummed chunks or segments. Its nccl
engine also brings its own rendezvous (a StatelessProcessGroup the trainer
hosts, one group kept for the engine's life) with no abort flag, no deadline
per transfer and no verdict: a receiver cannot stop when a peer fails, nor
wait for the synchronizer's COMMITTED before it loads. The synchronizer's
groups are one per transfer, bounded by its deadline, abortable from either
side and gloo-capable, so the worker joins them with Flywheel's own
broadcast code, the same the trainer sends with. The base
`update_weights` calls `torch.accelerator.synchronize()`, which raises on the
CPU build; this one synchronizes only a CUDA device.

`register()` adds it to vLLM's factory, which raises on a second registration
of a name; the worker extension (`vllm_worker`) calls it when vLLM imports it
in the worker process, before the worker creates its engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import mmap
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo,
)

from flywheel import errors
from flywheel.errors import Aborted, DeadlineExceeded, FailedPrecondition, FlywheelError, NotFound
from flywheel.transfer.broadcast import GroupSpec
from services.rollout.engine.base import LoadFaults
from services.rollout.engine.vllm_load import (
    PreparedLoad, ReceivedDigests, commit, corrupt_readable, faulty, load_in_place, prepare_twin, resident_digests,
)

#: The backend name in vLLM's factory (`weight_transfer_config.backend`).
BACKEND = "flywheel"

_ERRORS = {cls.code: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, FlywheelError)}
_CODED = re.compile(r"\[flywheel:([A-Z_]+)\] (.*)", re.DOTALL)


def coded(code: str, message: str) -> str:
    """An error message that carries its status code through vLLM's RPC (which keeps only text)."""
    return f"[flywheel:{code}] {message}"


def decode_error(text: str) -> tuple[str, str] | None:
    """(code, message) of a `coded` message found anywhere in `text`."""
    match = _CODED.search(text)
    return (match.group(1), match.group(2)) if match else None


def error_of(code: str, message: str) -> FlywheelError:
    """The FlywheelError of status `code` (FlywheelError itself, INTERNAL, for a code it has no class of)."""
    return _ERRORS.get(code, FlywheelError)(message)


@dataclass
class FlywheelInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: each update names its source."""


@dataclass
class SharedTensors:
    """Tensors laid out in an anonymous memory file (memfd) of process `pid`."""

    pid: int
    fd: int
    size: int
    #: [name, dtype (e.g. "float32"), shape, byte offset] per tensor.
    tensors: list[list[Any]]


@dataclass
class FlywheelUpdateInfo(WeightTransferUpdateInfo):
    """One update; exactly one of ticket, synchronizer, group, shared or files."""

    #: A version `stage` pulled and verified, by its ticket.
    ticket: str = ""
    #: Or pull now: the synchronizer's "host:port" and the version to pull.
    synchronizer: str = ""
    version: int = 0
    token: str | None = field(default=None, repr=False)
    #: Deadline of the whole pull, in seconds.
    timeout_seconds: float = 300.0
    max_message_bytes: int = 64 * 2**20
    #: False: a source that cannot be reached fails at once (a nearby one; MemorySource.retry_unreached).
    retry_unreached: bool = True
    #: Keep the tensors this version is staged in, once loaded, and stage the next one into them
    #: (no page faults per update; holds a model's worth of memory in the worker between updates).
    reuse_staging: bool = False
    #: TLS files to call the synchronizer with (fields of `flywheel.runtime.tls.TlsFiles`); none: the worker
    #: process's own (FLYWHEEL_TLS_* variables).
    tls: dict[str, str | None] | None = None
    #: Or tensors the service verified, in its memory (`SharedTensors` as a dict).
    shared: dict[str, Any] | None = None
    #: Or safetensors files the service verified (a checkpoint directory's).
    files: list[str] | None = None
    #: Or (`stage` only) the transfer group to receive in: `flywheel.transfer.broadcast.GroupSpec`'s fields.
    group: dict[str, Any] | None = None
    #: FAULT INJECTION (tests only): `LoadFaults` fields for this load.
    faults: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [bool(self.ticket), bool(self.synchronizer), self.shared is not None, self.files is not None,
                 self.group is not None]
        if sum(given) != 1:
            raise ValueError("a flywheel update names exactly one of ticket, synchronizer, group, shared or files")
        if self.synchronizer and self.version < 1:
            raise ValueError("a flywheel update from a synchronizer names a version >= 1")


class FlywheelWeightTransferEngine(WeightTransferEngine[FlywheelInitInfo, FlywheelUpdateInfo]):
    init_info_cls = FlywheelInitInfo
    update_info_cls = FlywheelUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        #: ticket -> (the pull or receive: (bytes, tensors), whether its tensors are kept for the next one)
        self._staged: dict[str, tuple[concurrent.futures.Future, bool]] = {}
        #: ticket -> the flag a receive in a transfer group polls (raised by `drop`)
        self._aborts: dict[str, threading.Event] = {}
        #: Tensors of the last version loaded, to stage the next one into (reuse_staging).
        self._free: dict[str, torch.Tensor] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._specs: dict | None = None
        #: RECEIVED digests of the last load (checkpoint names).
        self._received: dict[str, bytes] = {}
        #: What the last commit let go (the version before it), kept until the next version is staged, so
        #: that freeing it is not in generation's pause.
        self._released: list[torch.Tensor] = []
        #: Every version's twin is prepared on this one thread: with a new thread per version glibc kept more
        #: of the freed versions (a tiny model's 23.6 MB versions: 18 MB an update, against about 4 MB on one
        #: thread).
        self._preparer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flywheel-prepare")

    # -- vLLM's lifecycle ------------------------------------------------------

    def init_transfer_engine(self, init_info: FlywheelInitInfo) -> None:
        self._pull_loop()

    def start_weight_update(self) -> None:
        """Nothing to prepare: loading starts only once the whole version is verified."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize: `receive_weights` reloads the model whole."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes torch.accelerator, which raises on CPU builds.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except FlywheelError as exc:
            raise RuntimeError(coded(exc.code, str(exc))) from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: FlywheelUpdateInfo) -> None:
        if update_info.group is not None:
            raise ValueError("a transfer group's version is staged first (flywheel_stage) and loaded by its "
                             "ticket once the synchronizer declared the transfer COMMITTED")
        faults = LoadFaults(**(update_info.faults or {}))
        if update_info.files is not None:
            self._load(_file_tensors(update_info.files), faults)
        elif update_info.shared is not None:
            with _mapped(SharedTensors(**update_info.shared)) as tensors:
                self._load(tensors.items(), faults)
        else:
            if update_info.ticket:
                future, reuse = self._staged.pop(update_info.ticket, (None, False))
                if future is None:
                    raise NotFound(f"no version staged under ticket {update_info.ticket}")
            else:
                future, reuse = self._start_pull(update_info), update_info.reuse_staging
            _, tensors, *prepared = _result(future)
            self._aborts.pop(update_info.ticket, None)
            if prepared:
                self._commit(prepared[0], faults)
            else:
                self._load(tensors.items(), faults)
            # Kept only if the model took copies: a staging tensor it still held would change under it.
            self._free = tensors if reuse and not _shares_storage(self.model, tensors) else None

    def shutdown(self) -> None:
        for ticket in [*self._staged, *self._aborts]:
            self.drop(ticket)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        self._preparer.shutdown(wait=False, cancel_futures=True)

    # -- staging ahead of an update (the worker extension's RPCs) --------------

    def stage(self, ticket: str, update_info: dict[str, Any]) -> None:
        """Starts pulling and verifying a version, or receiving it in a transfer group, in the
        background; returns at once."""
        info = self.parse_update_info(update_info)
        if not info.synchronizer and info.group is None:
            raise ValueError("stage needs an update info naming a synchronizer or a transfer group")
        self._released = []  # the version the last commit replaced, freed here, outside generation's pause
        self.drop(ticket)
        if info.group is not None:
            self._staged[ticket] = (self._start_receive(ticket, GroupSpec(**info.group)), False)
        else:
            self._staged[ticket] = (self._start_pull(info), info.reuse_staging)

    def staged(self, ticket: str) -> dict[str, Any]:
        """{"state": "pending"}, {"state": "ready", "bytes": n} or {"state": "failed", "code", "message"}
        (a failed stage is forgotten once reported)."""
        future, _ = self._staged.get(ticket, (None, False))
        if future is None:
            return {"state": "failed", "code": NotFound.code, "message": f"no version staged under ticket {ticket}"}
        if not future.done():
            return {"state": "pending"}
        try:
            nbytes, *_ = _result(future)
        except FlywheelError as exc:
            del self._staged[ticket]
            self._aborts.pop(ticket, None)
            return {"state": "failed", "code": exc.code, "message": str(exc)}
        return {"state": "ready", "bytes": nbytes}

    def prepare(self, ticket: str, faults: dict[str, Any]) -> None:
        """Loads (and on CPU repacks) the version staged under `ticket` into a twin of the model in the
        background (`vllm_load.prepare_twin`), so that the update itself only commits it; the ticket is
        ready again once it is prepared. Failures are the ticket's (`staged`)."""
        future, reuse = self._staged.get(ticket, (None, False))
        if future is None:
            raise NotFound(f"no version staged under ticket {ticket}")
        chained: concurrent.futures.Future = concurrent.futures.Future()
        specs, wrong = self._served_specs(), LoadFaults(**(faults or {}))

        def run() -> None:
            if not chained.set_running_or_notify_cancel():
                return
            try:
                nbytes, tensors = _result(future)
                prepared = prepare_twin(self.vllm_config, self.model, tensors.items(), specs, wrong)
                chained.set_result((nbytes, tensors, prepared))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
                chained.set_exception(exc)

        self._staged[ticket] = (chained, reuse)
        self._preparer.submit(run)

    def drop(self, ticket: str) -> None:
        """Cancels or forgets a staged version (nothing if unknown); a receive in a transfer group
        stops at its next check (and its peers with it)."""
        aborted = self._aborts.pop(ticket, None)
        if aborted is not None:
            aborted.set()
        future, _ = self._staged.pop(ticket, (None, False))
        if future is not None:
            future.cancel()

    # -- internals -------------------------------------------------------------

    def _pull_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop pulls run on, on a thread of its own (the worker's thread runs the model)."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="flywheel-weight-pull", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    def _start_pull(self, info: FlywheelUpdateInfo) -> concurrent.futures.Future:
        # The kept set is this pull's alone now; a failed pull leaves it half written, and it is dropped.
        staging, self._free = (self._free if info.reuse_staging else None), None
        return asyncio.run_coroutine_threadsafe(self._pull(info, staging), self._pull_loop())

    def _start_receive(self, ticket: str, spec: GroupSpec) -> concurrent.futures.Future:
        """Receives in the group on a thread of its own (blocking, bounded by the group's deadline)."""
        from flywheel.transfer.broadcast import placeholders, receive

        if spec.backend != "gloo" and self.device.type != "cuda":
            raise FailedPrecondition(f"transfer group {spec.group_id} uses {spec.backend}, which needs a CUDA device, "
                                     f"but this worker runs on {self.device.type}; allocate the group with backend gloo")
        device = torch.device("cpu") if spec.backend == "gloo" else self.device
        like = placeholders(self._served_specs(), device)
        aborted = self._aborts[ticket] = threading.Event()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                tensors = receive(spec, like, should_abort=aborted.is_set)
                future.set_result((sum(t.nbytes for t in tensors.values()), tensors))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
                future.set_exception(exc)

        threading.Thread(target=run, name=f"flywheel-receive-{spec.group_id}", daemon=True).start()
        return future

    async def _pull(
        self, info: FlywheelUpdateInfo, staging: dict[str, torch.Tensor] | None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        from flywheel.runtime.tls import TlsFiles
        from services.rollout.engine.pull import pull_tensors

        # None: the worker process's own TLS (its env variables).
        tls = TlsFiles(**{k: Path(v) if v else None for k, v in info.tls.items()}) if info.tls is not None else None
        try:
            pulled = await asyncio.wait_for(
                pull_tensors(info.synchronizer, info.version, self._served_specs(), token=info.token,
                             timeout=info.timeout_seconds, max_message_bytes=info.max_message_bytes, tls=tls,
                             staging=staging, retry_unreached=info.retry_unreached),
                info.timeout_seconds,
            )
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"version {info.version} not pulled from {info.synchronizer} within {info.timeout_seconds:g} s"
            ) from None
        return int(pulled.nbytes), pulled.tensors

    def measure(self, names: list[str]) -> dict[str, Any]:
        """What this worker measured of the weights it holds: RESIDENT digests (read back now) and
        the RECEIVED ones its loader hashed during the last load, under the checkpoint's names."""
        specs = {n: s for n, s in self._served_specs().items() if n in set(names)}
        resident = resident_digests(self.model, specs)
        unread = len(specs) - len(resident)
        why = (f"{unread} tensor(s) not held as the checkpoint holds them (repacked for vLLM's kernels, or "
               "sharded)") if unread else ""
        return {"resident": resident, "received": {n: d for n, d in self._received.items() if n in specs},
                "unreadable": why}

    def _served_specs(self) -> dict:
        """Names, dtypes and shapes of the checkpoint the model was loaded from, in the dtype it is served in:
        what an update must provide."""
        if self._specs is None:
            from services.rollout.engine.checkpoint import checkpoint_specs

            self._specs = checkpoint_specs(Path(self.model_config.model), self.model_config.dtype)
        return self._specs

    def _commit(self, prepared: PreparedLoad, faults: LoadFaults) -> None:
        """Commits a prepared version (inside generation's pause: pointer swaps)."""
        self._received = {}
        self._released = commit(prepared, faults)
        self._received = prepared.received
        if faults.corrupt_readable:
            corrupt_readable(self.model, self._served_specs())

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], faults: LoadFaults) -> None:
        """Loads a version, hashing each tensor as the loader takes it (RECEIVED). The digests of
        a load that failed are dropped: nothing was received whole."""
        specs = self._served_specs()
        received = ReceivedDigests()
        self._received = {}
        stream = received.hashing(weights)
        if faults.any:
            stream = faulty(stream, faults, specs)
        load_in_place(self.vllm_config, self.model, stream)
        self._received = received.digests
        if faults.corrupt_readable:
            corrupt_readable(self.model, specs)


def _result(future: concurrent.futures.Future) -> Any:
    """The pull's result, its failure as a FlywheelError (status code kept)."""
    try:
        return future.result()
    except FlywheelError:
        raise
    except concurrent.futures.CancelledError:
        raise Aborted("the staged version was dropped before it was loaded") from None
    except Exception as exc:  # noqa: BLE001 - the codec's or the channel's own errors
        raise FlywheelError(f"staging the version failed: {type(exc).__name__}: {exc}") from exc


def _shares_storage(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"}
    return any(t.untyped_storage().data_ptr() in held for t in tensors.values())


def _file_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, fh.get_tensor(name)


@contextlib.contextmanager
def _mapped(shared: SharedTensors) -> Iterator[dict[str, torch.Tensor]]:
    """The service's shared tensors, read in place (views valid inside the block only)."""
    fd = os.open(f"/proc/{shared.pid}/fd/{shared.fd}", os.O_RDONLY)
    try:
        region = mmap.mmap(fd, shared.size, prot=mmap.PROT_READ) if shared.size else None
    finally:
        os.close(fd)
    try:
        tensors = {}
        for name, dtype, shape, offset in shared.tensors:
            kind = getattr(torch, dtype)
            count = _numel(shape) * torch.empty((), dtype=kind).element_size()
            if count == 0 or region is None:
                tensors[name] = torch.empty(shape, dtype=kind)
                continue
            # A read-only map: torch warns that the tensor is not writable; the load only reads it.
            with _quiet_nonwritable():
                raw = torch.frombuffer(region, dtype=torch.uint8, count=count, offset=offset)
            tensors[name] = raw.view(kind).reshape(shape)
        yield tensors
        del tensors
    finally:
        if region is not None:
            with contextlib.suppress(BufferError):
                region.close()


@contextlib.contextmanager
def _quiet_nonwritable() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        yield


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def register() -> None:
    """Adds this engine to vLLM's factory as `BACKEND`; a second call changes nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    loader = WeightTransferEngineFactory._registry.get(BACKEND)
    if loader is None:
        WeightTransferEngineFactory.register_engine(BACKEND, FlywheelWeightTransferEngine)
    elif loader() is not FlywheelWeightTransferEngine:
        raise RuntimeError(f"vLLM's weight-transfer backend {BACKEND!r} is registered to another engine")
