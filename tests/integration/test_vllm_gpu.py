"""The vLLM rollout on CUDA: weight updates into a GPU worker, co-located (ipc) and across
GPUs (nccl), and with tensor parallelism. Marked `gpu`; they skip without vLLM and enough
CUDA devices, which is every machine this project is tested on so far (CI has no GPU; the
lent single-GPU machines have no vLLM): their run is owed to a multi-GPU machine with vLLM.

* one GPU: a trainer in another process on the same GPU hands a version over through
  an ipc transfer group, received by vLLM's worker itself; greedy tokens are then what
  transformers computes with the new weights;
* two GPUs: the trainer on cuda:1 broadcasts over nccl to the worker on cuda:0;
* two GPUs, tensor_parallel_size 2: a MEMORY update (each worker pulls the version and loads
  its shard) and a transfer-group update (the service receives and shares the tensors with
  both workers) both move the rollout to the new weights.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from tests.conftest import TEST_TOKEN
from tests.integration.test_rollout_nccl_update import (
    BUCKET_BYTES, PROMPT, ROLLOUT, STEPS, TRAINER, cluster, greedy, linked_server, nccl_source, update,
)
from tests.unit.rollout.rollout_helpers import ServerThread, need_engine, reference_greedy, rollout_config

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]


def gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-gpu") / "model")


def scaled(model_dir: Path, factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def _trainer_sends(group: dict, device: str, model_dir: str, factor: float, address: str) -> None:
    """The trainer's side in its own process (NCCL wants one rank per GPU; ipc, another process)."""
    from flywheel.synchronizer.client import SynchronizerClient
    from flywheel.synchronizer.participant import send_in_group
    from flywheel.synchronizer.types import GroupInfo

    torch.cuda.set_device(torch.device(device))
    state = {k: v.to(device) for k, v in scaled(Path(model_dir), factor).items()}

    async def send() -> None:
        async with SynchronizerClient(address, token=TEST_TOKEN) as client:
            await send_in_group(client, TRAINER, GroupInfo(**group), state, bucket_bytes=BUCKET_BYTES)

    asyncio.run(send())


async def transfer_update(server: ServerThread, model_dir: Path, version: int, backend: str, trainer_device: str,
                          factor: float) -> None:
    """Allocates a group with `backend`, runs the trainer in a child process, updates the rollout; checks greedy."""
    from dataclasses import asdict

    async with cluster(server) as c, open_channel(server.address, token=TEST_TOKEN) as channel:
        rollout = pb_grpc.RolloutServiceStub(channel)
        group = await c.client.allocate_group(version, TRAINER, [ROLLOUT], timeout_seconds=120, backend=backend)
        trainer = multiprocessing.get_context("spawn").Process(
            target=_trainer_sends, args=(asdict(group), trainer_device, str(model_dir), factor, c.address))
        trainer.start()
        try:
            response = await update(rollout, version, nccl_source(group))
        finally:
            await asyncio.to_thread(trainer.join, 120)
        assert response.weight_version == version
        after = await greedy(rollout)
        assert list(after.completion_token_ids) == reference_greedy(model_dir, PROMPT, STEPS, scaled(model_dir, factor))
    server.track.version = version


@pytest.fixture
def one_gpu_server(model_dir: Path):
    """The vLLM rollout, configured with a synchronizer of its own (started with it)."""
    need_engine("vllm")
    with linked_server(lambda link: rollout_config(model_dir, "vllm", synchronizer=link)) as server:
        yield server


@gpus(1)
async def test_a_co_located_trainer_hands_a_version_to_vllms_worker_through_ipc(one_gpu_server, model_dir) -> None:
    await transfer_update(one_gpu_server, model_dir, 1, "ipc", "cuda:0", 1.5)


@gpus(2)
async def test_a_trainer_on_another_gpu_broadcasts_to_vllms_worker_over_nccl(one_gpu_server, model_dir) -> None:
    await transfer_update(one_gpu_server, model_dir, 1, "nccl", "cuda:1", 1.5)


@gpus(2)
async def test_with_tensor_parallelism_both_update_paths_reach_every_shard(model_dir: Path) -> None:
    from tests.integration.test_vllm_weight_transfer import push
    from flywheel.common.v1 import common_pb2
    from flywheel.rollout.v1 import rollout_pb2 as pb

    need_engine("vllm")

    def config_of(link: dict):
        config = rollout_config(model_dir, "vllm", synchronizer=link)
        config.engine.args["tensor_parallel_size"] = 2
        return config

    with linked_server(config_of) as server:
        # MEMORY, from the rollout's own synchronizer: each worker pulls the version and loads its shard.
        new = scaled(model_dir, 0.7)
        await push(server.sync_address, new, 1)
        async with open_channel(server.address, token=TEST_TOKEN) as channel:
            rollout = pb_grpc.RolloutServiceStub(channel)
            request = pb.UpdateWeightsRequest(version=1, method=common_pb2.SYNC_METHOD_MEMORY,
                                              memory=pb.MemorySource())
            assert (await rollout.UpdateWeights(request, timeout=300)).weight_version == 1
            after = await greedy(rollout)
            assert list(after.completion_token_ids) == reference_greedy(model_dir, PROMPT, STEPS, new)
        server.track.version = 1
        # A transfer group: one rank per replica, so the service receives and shares with both workers.
        await transfer_update(server, model_dir, 2, "nccl", "cuda:1", 1.3)
