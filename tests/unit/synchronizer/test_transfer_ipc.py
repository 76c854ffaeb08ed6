"""Backend ipc of flywheel.transfer.broadcast: members on one GPU hand buckets over through
CUDA IPC. Without CUDA both sides refuse it up front (FAILED_PRECONDITION, before any
rendezvous); the handoff itself runs on a GPU (marked `gpu`): the trainer's side in a child
process, as a co-located trainer is, the receiver here."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.transfer import cuda_ipc
from flywheel.transfer.broadcast import GroupSpec, receive, send
from flywheel.testing.net import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def spec(rank: int, port: int, seconds: float = 60.0) -> GroupSpec:
    return GroupSpec(f"ipc{port}", f"127.0.0.1:{port}", 2, rank, "ipc", time.time() + seconds, 1)


def state(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (512, 64), "layers.0.mlp.weight": (256, 64), "norm.weight": (64,)}
    return {name: torch.randn(shape, generator=g).to(device) for name, shape in shapes.items()} | {
        "bf16.weight": torch.randn(300, generator=g).to(torch.bfloat16).to(device)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: ipc is possible")
def test_without_cuda_both_sides_refuse_ipc_before_the_rendezvous() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(FailedPrecondition, match="ipc hands over CUDA memory"):
        send(spec(0, port), state("cpu"))
    with pytest.raises(FailedPrecondition, match="ipc hands over CUDA memory"):
        receive(spec(1, port), state("cpu"))
    assert time.monotonic() - started < 5, "a refused side waited for its peer"
    with pytest.raises(FailedPrecondition):
        cuda_ipc.share(torch.zeros(4))
    assert cuda_ipc.gpu_label("cpu") == {} and cuda_ipc.gpu_uuid("cpu") == ""


def _trainer(port: int, bucket_bytes: int, fail: bool, device: str = "cuda:0") -> None:
    torch.cuda.set_device(0)
    tensors = state(device)
    if fail:  # a sender whose description of its buffer is damaged: the receiver refuses it
        from flywheel.transfer import broadcast

        real = broadcast.share
        broadcast.share = lambda buffer: {**real(buffer), "dtype": "no_such_dtype"}
    try:
        send(spec(0, port), tensors, bucket_bytes=bucket_bytes)
    except Exception:  # noqa: BLE001 - the receiver's verdict is what the test checks
        pass


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(("bucket_bytes", "held_on"), [(64 * 1024, "cuda:0"), (1 << 30, "cuda:0"), (64 * 1024, "cpu")],
                         ids=["several buckets", "one bucket", "host tensors (a sharded trainer's export)"])
def test_a_co_located_trainer_hands_its_weights_over_bit_exact(bucket_bytes: int, held_on: str) -> None:
    port = free_port()
    context = multiprocessing.get_context("spawn")
    trainer = context.Process(target=_trainer, args=(port, bucket_bytes, False, held_on))
    trainer.start()
    try:
        like = {name: torch.zeros_like(t) for name, t in state("cuda:0").items()}
        staged = receive(spec(1, port), like)
    finally:
        trainer.join(60)
    want = state("cpu")
    assert set(staged) == set(want)
    for name, tensor in staged.items():
        assert tensor.device.type == "cuda" and torch.equal(tensor.cpu(), want[name]), name
    assert cuda_ipc.gpu_label("cuda:0") == {"gpu": cuda_ipc.gpu_uuid("cuda:0")}


@pytest.mark.gpu
@CUDA
def test_a_malformed_buffer_description_is_refused() -> None:
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, 1 << 20, True))
    trainer.start()
    try:
        with pytest.raises(InvalidArgument, match="malformed"):
            receive(spec(1, port), {name: torch.zeros_like(t) for name, t in state("cuda:0").items()})
    finally:
        trainer.join(60)
