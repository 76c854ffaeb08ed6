"""The trainer's ranks: one policy sharded over N processes with FSDP2.

With `parallel.world_size` N > 1 (or `parallel.shard` at N = 1) the service
process is rank 0 and starts ranks 1..N-1 itself (`python -m
services.trainer.rank`, one process per GPU on one machine). Every rank
loads the same model, shards it with `fully_shard` (each decoder layer, then
the root) and builds its optimizer over its shards. Collectives run on the
default group (nccl on CUDA, gloo on CPU); commands and small results travel
on a second, gloo group (`Ranks.command`): rank 0 validates a request,
broadcasts the method and its arguments, and every rank runs the same code
(SPMD), so the collectives inside FSDP meet in the same order everywhere.

Data parallel: each rank takes a contiguous slice of the batch's rows; loss
denominators are the whole batch's, and each rank's loss is multiplied by N
before FSDP averages the gradients over the ranks (gloo has no pre-multiplied
sum to turn the average off), so N ranks compute the gradient of the same
loss as one rank (equal within floating-point reassociation).

Weights leave through `gather_buckets`: one parameter at a time is gathered
(`DTensor.full_tensor`), copied to the host and freed on the device, and
handed out in buckets, so no rank holds the whole model twice.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flywheel.errors import FailedPrecondition
from services.trainer.batch import MicroBatch
from services.trainer.tied import tied_duplicates, tied_targets

log = logging.getLogger(__name__)

#: Environment of a rank process (`services.trainer.rank`); its config arrives on stdin as JSON.
ENV_RANK, ENV_WORLD, ENV_STORE = "FLYWHEEL_TRAINER_RANK", "FLYWHEEL_TRAINER_WORLD_SIZE", "FLYWHEEL_TRAINER_STORE"
#: "<level> <format>" of the service's log (server.log_level, server.log_format), for the ranks' logs.
ENV_LOG = "FLYWHEEL_TRAINER_RANK_LOG"
#: Config sections a rank needs (the server's, with its tokens, stays in the service).
RANK_SECTIONS = ("model", "reference", "optimizer", "loss", "limits", "checkpoint", "parallel")


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r of a CUDA trainer uses GPU r (one process per GPU); CPU ranks share the CPU."""
    d = torch.device(device)
    return f"cuda:{rank}" if d.type == "cuda" else device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (each becomes one FSDP unit)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise FailedPrecondition(f"parallel: cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def shard_model(model: nn.Module, device: str) -> nn.Module:
    """FSDP2 over the default process group: each decoder layer, then the root
    (embeddings, final norm and a tied head stay together in the root unit).

    `model` may still be on the CPU: each unit's weights move to `device` as it
    is sharded, so the GPU holds one layer whole at most, never the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Named, not FSDP's default (the machine's accelerator): a CPU trainer on a GPU machine stays on the CPU.
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Frees whatever FSDP left gathered (the root stays gathered after a forward
    without backward, e.g. a log-prob pass): parameters are DTensor shards again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), or t itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- rows of the batch


def rank_share(plans: list[MicroBatch], rank: int, world: int) -> list[MicroBatch | None]:
    """This rank's contiguous share of a planned batch's micro-batches.

    Every rank gets the same number of entries (FSDP's collectives run once per
    forward and backward on every rank); None stands for a pass with no rows of
    this rank's own, run on a stand-in row and contributing zero. Shares are
    contiguous and in rank order, so gathering the ranks' outputs in order gives
    the planned batch's row order."""
    per = max(1, math.ceil(len(plans) / world))
    mine: list[MicroBatch | None] = list(plans[rank * per:(rank + 1) * per])
    return mine + [None] * (per - len(mine))


# ---------------------------------------------------------------- weights out


def export_names(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, tensor) of `model.state_dict()` in order, tied duplicates dropped as
    `tied.drop_tied` does (the names transformers declares tied go first,
    else the later name); tensors are the live (possibly sharded) parameters."""
    objects = dict(model.named_parameters(remove_duplicate=False))
    objects.update(dict(model.named_buffers(remove_duplicate=False)))
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    groups: dict[int, list[str]] = {}
    for name in model.state_dict():
        groups.setdefault(id(objects[name]), []).append(name)
    doomed = tied_duplicates(groups.values(), tied_targets(hf))
    return [(n, objects[n]) for n in model.state_dict() if n not in doomed]


def gather_buckets(model: nn.Module, bucket_bytes: int, *, keep: bool = True) -> Iterator[dict[str, Tensor]]:
    """The model's export tensors, gathered one parameter at a time into host
    buckets of about `bucket_bytes` (a tensor larger than that is a bucket of
    its own). Every rank must iterate it to the end (each gather is a
    collective); ranks with `keep` False yield nothing and keep nothing."""
    from torch.distributed.tensor import DTensor

    reshard(model)
    bucket: dict[str, Tensor] = {}
    size = 0
    with torch.no_grad():
        for name, tensor in export_names(model):
            whole = full(tensor.detach())
            if keep:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                # A gather of one rank may hand back the shard itself: the bucket gets a copy either way.
                fresh = whole.device.type == "cpu" and whole.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
                host = whole if fresh else whole.to("cpu", copy=True)
                bucket[name] = host.detach()
                size += host.numel() * host.element_size()
            del whole  # the device copy goes before the next gather
            if keep and size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
    if bucket:
        yield bucket


def gather_state(model: nn.Module, bucket_bytes: int, *, keep: bool = True) -> dict[str, Tensor]:
    """Every export tensor on the host (rank 0 keeps them; others pass `keep=False`)."""
    state: dict[str, Tensor] = {}
    for bucket in gather_buckets(model, bucket_bytes, keep=keep):
        state.update(bucket)
    return state


# ---------------------------------------------------------------- processes


@dataclass
class Ranks:
    """This process's place among the trainer's ranks, and rank 0's handle on the others."""

    rank: int
    world_size: int
    control: object  # the gloo group commands and small results travel on
    workers: list[subprocess.Popen]

    # -- rank 0

    @classmethod
    def start(cls, sections: dict, world_size: int, device: str, timeout_seconds: float, log_setting: str = "INFO json") -> Ranks:
        """Rank 0: hosts the rendezvous on 127.0.0.1, starts ranks 1..N-1, joins the group."""
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_seconds))
        workers: list[subprocess.Popen] = []
        config = json.dumps(sections)
        for rank in range(1, world_size):
            env = {**os.environ, ENV_RANK: str(rank), ENV_WORLD: str(world_size), ENV_STORE: f"127.0.0.1:{store.port}",
                   ENV_LOG: log_setting}
            proc = subprocess.Popen([sys.executable, "-m", "services.trainer.rank"], stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            proc.stdin.write(config.encode())
            proc.stdin.close()
            workers.append(proc)
        try:
            ranks = cls._join(store, 0, world_size, device, timeout_seconds, workers)
        except BaseException:
            for proc in workers:
                proc.kill()
            raise
        ranks._store = store  # type: ignore[attr-defined]  # kept alive while the group lives
        log.info("trainer ranks started", extra={"world_size": world_size, "backend": backend_for(device)})
        return ranks

    @classmethod
    def join_from_env(cls, device: str, timeout_seconds: float) -> Ranks:
        """Ranks 1..N-1: joins the group rank 0 hosts (`ENV_*`)."""
        host, port = os.environ[ENV_STORE].rsplit(":", 1)
        rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=datetime.timedelta(seconds=timeout_seconds))
        ranks = cls._join(store, rank, world, device, timeout_seconds, [])
        ranks._store = store  # type: ignore[attr-defined]
        return ranks

    @classmethod
    def _join(cls, store, rank: int, world: int, device: str, timeout_seconds: float, workers) -> Ranks:
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(rank_device(device, rank)))
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank, world, control, workers)

    def command(self, name: str, args: tuple) -> None:
        """Rank 0: tells every other rank to run `name(*args)`."""
        # A rank that is gone would leave the collectives waiting for timeout_seconds.
        dead = [(r, p.returncode) for r, p in enumerate(self.workers, start=1) if p.poll() is not None]
        if dead:
            raise FailedPrecondition(f"trainer rank {dead[0][0]} exited (code {dead[0][1]}); restart the trainer")
        dist.broadcast_object_list([name, args], src=0, group=self.control)

    def receive(self) -> tuple[str, tuple]:
        """Ranks 1..N-1: the next command."""
        box: list = [None, None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0], box[1]

    # -- every rank

    def all_agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank (a collective)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
        return bool(flag.item())

    def gather(self, value: object) -> list[object] | None:
        """Rank 0: every rank's `value`, in rank order; other ranks: None (a collective)."""
        out: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def close(self, timeout: float = 60.0) -> None:
        """Rank 0: stops the other ranks and leaves the group; others: leave the group."""
        if self.rank == 0 and self.workers:
            try:
                self.command("stop", ())
            except Exception:  # noqa: BLE001 - a dead rank: kill the rest below
                log.exception("trainer ranks: stop command failed")
            for proc in self.workers:
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
