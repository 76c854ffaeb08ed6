"""Weight export in-process: an engine on the tiny model and an embedded synchronizer.

MEMORY and CHECKPOINT versions must be bit-identical to the live parameters
under the names of the HF checkpoint the model came from; bad requests are
rejected naming the field; GetInfo never waits for an export.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flywheel.common.v1 import common_pb2
from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer
from services.trainer.config import SyncConfig
from services.trainer.export import MANIFEST_FILE, WeightExporter, export_state
from services.trainer.servicer import TrainerServicer, export_weights
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine
from tests.unit.trainer.trainer_helpers import make_batch


def hf_names(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


def live_hf(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    sd = engine.policy.model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def step(engine: TrainingEngine) -> None:
    engine.train_step(make_batch(), LossRequest())


async def test_memory_and_checkpoint_are_bit_identical(make_engine, tiny_model: Path, tmp_path: Path) -> None:
    engine = make_engine(checkpoint={"allowed_roots": [str(tmp_path / "exports")]})
    step(engine)
    live = live_hf(engine)
    async with embedded_synchronizer(checkpoint_root=tmp_path) as server:
        exporter = WeightExporter(engine, SyncConfig(synchronizer_address=server.address))
        result = await exporter.memory()
        assert result.weight_version == 1 and result.bytes > 0
        async with SynchronizerClient(server.address) as client:
            pulled = await client.pull_weights(1)
        assert set(pulled.tensors) == hf_names(tiny_model)  # from_pretrained names, tied lm_head dropped
        for name, tensor in pulled.tensors.items():
            assert torch.equal(tensor, live[name]), name

        step(engine)
        live = live_hf(engine)
        ckpt = await exporter.checkpoint(str(tmp_path / "exports"))
        assert ckpt.weight_version == 2 and Path(ckpt.path) == tmp_path / "exports" / "version_2"
        files = load_file(Path(ckpt.path) / "model.safetensors")
        assert set(files) == hf_names(tiny_model)
        assert all(torch.equal(t, live[n]) for n, t in files.items())
        assert (Path(ckpt.path) / "config.json").is_file() and (Path(ckpt.path) / MANIFEST_FILE).is_file()
        assert not list((tmp_path / "exports").glob(".tmp-*"))
        async with SynchronizerClient(server.address) as client:
            assert await client.get_checkpoint(2) == (2, ckpt.path)
    assert engine.policy.model.training  # back in train mode


async def test_lora_merged_and_adapter_exports(make_engine, tiny_model: Path) -> None:
    engine = make_engine(model={"lora": {"enabled": True, "rank": 4}})
    step(engine)
    merged = export_state(engine.policy, merge_lora=True)
    assert set(merged) == hf_names(tiny_model)
    reference = engine.policy.hf_state_dict()
    assert all(torch.equal(merged[n], reference[n]) for n in merged)
    adapters = export_state(engine.policy, merge_lora=False)
    assert adapters and all("lora_" in n for n in adapters)


async def test_rejections_and_info_not_blocked(make_engine, tmp_path: Path) -> None:
    engine = make_engine(checkpoint={"allowed_roots": [str(tmp_path)]})
    servicer = TrainerServicer(engine)
    exporter = servicer.exporter
    with pytest.raises(FailedPrecondition, match="version 0"):
        await exporter.checkpoint(str(tmp_path / "x"))
    step(engine)
    bad = [
        (pb.ExportWeightsRequest(), "method"),
        (pb.ExportWeightsRequest(method=common_pb2.SYNC_METHOD_MEMORY, checkpoint=pb.CheckpointTarget(directory="d")),
         "checkpoint"),
        (pb.ExportWeightsRequest(method=common_pb2.SYNC_METHOD_NCCL), "nccl.group_id"),
        (pb.ExportWeightsRequest(method=common_pb2.SYNC_METHOD_MEMORY,
                                 memory=pb.MemoryTarget(chunk_bytes=1 << 30)),
         "memory.chunk_bytes"),
    ]
    for request, field in bad:
        with pytest.raises(InvalidArgument, match=field):
            await export_weights(exporter, request)
    # MEMORY goes to the trainer's own synchronizer; a request never names one.
    with pytest.raises(FailedPrecondition, match="sync.synchronizer_address"):
        await export_weights(exporter, pb.ExportWeightsRequest(method=common_pb2.SYNC_METHOD_MEMORY))

    # An export holding the training lock (as a long one does) never delays GetInfo.
    engine.lock.acquire()
    try:
        task = asyncio.ensure_future(exporter.checkpoint(str(tmp_path / "exports")))
        await asyncio.sleep(0.2)
        info = await asyncio.wait_for(servicer.GetInfo(pb.GetInfoRequest(), None), 1.0)
        assert info.weight_version == 1 and not task.done()
    finally:
        engine.lock.release()
    assert (await asyncio.wait_for(task, 60)).weight_version == 1


async def test_nccl_broadcast_over_gloo(make_engine, tiny_model: Path) -> None:
    from flywheel.synchronizer.participant import receive_version
    from flywheel.synchronizer.types import TransferState

    engine = make_engine()
    step(engine)
    live = live_hf(engine)
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as client:
        exporter = WeightExporter(engine, SyncConfig(synchronizer_address=server.address, trainer_id="trainer-0"))
        await client.register("trainer", "trainer-0", address="127.0.0.1:1", capabilities=["nccl"])
        await client.register("rollout", "rollout-0", capabilities=["nccl"])
        group = await client.allocate_group(1, "trainer-0", ["rollout-0"], timeout_seconds=30, backend="gloo")
        receiver = {n: torch.zeros_like(t) for n, t in export_state(engine.policy, False).items()}
        result, (outcome, staged) = await asyncio.gather(
            exporter.nccl(group.group_id), receive_version(client, "rollout-0", group, receiver)
        )
        assert result.weight_version == 1 and outcome.state == TransferState.COMMITTED and staged is not None
        assert set(receiver) == hf_names(tiny_model)
        assert all(torch.equal(t, live[n]) for n, t in receiver.items())


async def test_exports_carry_the_deployment_token(make_engine) -> None:
    from flywheel.errors import Unauthenticated

    engine = make_engine()
    step(engine)
    async with embedded_synchronizer(server={"auth_token": "s3cret"}) as server:
        sync = SyncConfig(synchronizer_address=server.address)
        with pytest.raises(Unauthenticated):
            await WeightExporter(engine, sync).memory()
        result = await WeightExporter(engine, sync, token="s3cret").memory()
        assert result.weight_version == 1
