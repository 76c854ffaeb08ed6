"""ExportWeights of a real trainer process to a real synchronizer.

After two training steps, a MEMORY version pulled back from the synchronizer
and a CHECKPOINT version's safetensors are both bit-identical to the model
of a SaveCheckpoint taken at the same step (the live parameters), under the
same names; the exported directory loads with `from_pretrained` and is
registered with the synchronizer; GetInfo answers while an export runs; bad
requests are rejected naming the field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flywheel.codec.identity import identify
from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from flywheel.trainer.client import TrainerClient, make_loss_spec, make_train_batch
from tests.conftest import TEST_TOKEN

pytestmark = pytest.mark.slow

MEMORY, CHECKPOINT, NCCL = common_pb2.SYNC_METHOD_MEMORY, common_pb2.SYNC_METHOD_CHECKPOINT, common_pb2.SYNC_METHOD_NCCL


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 700, (2, 16), generator=g)
    loss_mask = torch.zeros(2, 16)
    loss_mask[:, 6:] = 1.0
    return {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.int64), "loss_mask": loss_mask,
            "advantages": torch.tensor([1.0, -1.0]), "behaviour_logprobs": torch.full((2, 16), -6.9) * loss_mask}


async def rejected(call, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details(), info.value.details()


async def test_export_memory_and_checkpoint_bit_identical(run_service, tiny_model: Path, tmp_path: Path) -> None:
    async with embedded_synchronizer(checkpoint_root=tmp_path) as sync:
        # In a thread: the synchronizer answers on this loop, and the trainer registers with it before it
        # reports SERVING (a blocked loop cost it a 10 s registration deadline).
        trainer_proc = await asyncio.to_thread(
            run_service,
            # The checkpoint directory holds what this test saves and exports (request paths stay inside it).
            "trainer", "--model.path", str(tiny_model), "--checkpoint.dir", str(tmp_path),
            "--optimizer.lr", "1e-3", "--model.cpu-threads", "1", "--sync.synchronizer-address", sync.address,
            "--sync.publish", "false",  # exports by hand only: the operator's path
        )
        async with TrainerClient(trainer_proc.grpc_address, token=TEST_TOKEN, timeout=60) as trainer, \
                SynchronizerClient(sync.address) as client:
            stub = trainer.stub
            # Nothing to export before the first step.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ExportWeights(pb.ExportWeightsRequest(
                    method=MEMORY, memory=pb.MemoryTarget()))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            for step in (1, 2):
                await trainer.train_step(make_train_batch(**batch()), make_loss_spec("grpo"), expected_step=step - 1)
            saved = await trainer.save_checkpoint(str(tmp_path / "saved"))
            reference = load_file(Path(saved.path) / "model" / "model.safetensors")

            # MEMORY, with GetInfo polled while it runs.
            export = asyncio.ensure_future(stub.ExportWeights(pb.ExportWeightsRequest(
                method=MEMORY, memory=pb.MemoryTarget(chunk_bytes=64 << 10))))
            infos = 0
            while not export.done():
                info = await trainer.get_info(timeout=5)
                assert info.ready and info.weight_version == 2
                infos += 1
            assert infos >= 1
            memory = await export
            assert memory.weight_version == 2 and memory.bytes == sum(t.nbytes for t in reference.values())
            pulled = await client.pull_weights(2)
            assert pulled.tensors.keys() == reference.keys()
            for name, tensor in reference.items():
                assert torch.equal(pulled.tensors[name], tensor), name
            # The export names what it sent: the identity of the weights, which the synchronizer recorded.
            assert memory.identity == identify(reference).digest == (await client.status()).version(2).identity

            # CHECKPOINT (of the next version: versions are monotonic across methods):
            # atomically written, registered, loadable, bit-identical.
            await trainer.train_step(make_train_batch(**batch()), make_loss_spec("grpo"), expected_step=2)
            saved = await trainer.save_checkpoint(str(tmp_path / "saved"))
            reference = load_file(Path(saved.path) / "model" / "model.safetensors")
            ckpt = await stub.ExportWeights(pb.ExportWeightsRequest(
                method=CHECKPOINT, checkpoint=pb.CheckpointTarget(directory=str(tmp_path / "exports"))))
            assert ckpt.weight_version == 3 and ckpt.path == str(tmp_path / "exports" / "version_3")
            written = load_file(Path(ckpt.path) / "model.safetensors")
            assert written.keys() == reference.keys()
            assert all(torch.equal(written[n], t) for n, t in reference.items())
            assert ckpt.identity == identify(written).digest == (await client.status()).version(3).identity
            assert not list((tmp_path / "exports").glob(".tmp-*"))
            assert await client.get_checkpoint(0) == (3, ckpt.path)
            model = AutoModelForCausalLM.from_pretrained(ckpt.path)
            live = model.state_dict()
            assert all(torch.equal(live[n], t) for n, t in reference.items())

            # Bad requests name the field.
            await rejected(stub.ExportWeights(pb.ExportWeightsRequest()), "method")
            await rejected(stub.ExportWeights(pb.ExportWeightsRequest(
                method=MEMORY, checkpoint=pb.CheckpointTarget(directory="x"))), "checkpoint")
            # No directory: the trainer's sync.publish_dir; version 3 is out already, so refused as not newer.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ExportWeights(pb.ExportWeightsRequest(method=CHECKPOINT, checkpoint=pb.CheckpointTarget()))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in info.value.details()
            await rejected(stub.ExportWeights(pb.ExportWeightsRequest(method=NCCL, nccl=pb.NcclTarget())),
                           "nccl.group_id")
            assert (await trainer.get_info()).weight_version == 3
