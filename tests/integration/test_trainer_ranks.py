"""A trainer service sharded over 2 ranks (FSDP2 over gloo) as a real process over real gRPC.

The service starts its second rank itself. Its steps equal a one-process
engine's within tolerance, bad requests are refused without putting the
ranks out of step, a sharded checkpoint holds a loadable HF model, the
CHECKPOINT export writes the same weights, a graceful stop ends the rank,
a killed service takes its rank with it, and the restarted service resumes
the checkpoint to the uninterrupted run's next losses exactly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flywheel.models.tiny import build_tiny_model
from flywheel.trainer.client import TrainerClient, make_loss_spec, make_train_batch
from services.trainer.config import TrainerConfig
from services.trainer.forward import token_logprobs
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine
from tests.conftest import TEST_TOKEN
from tests.integration.test_trainer_service import fixed_batch

pytestmark = pytest.mark.slow

LOSS = make_loss_spec("grpo", is_cap=2.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def start(run_service, model: Path, checkpoints: Path, *extra: str):
    return run_service(
        "trainer", "--model.path", str(model), "--checkpoint.dir", str(checkpoints), "--optimizer.lr", "1e-3",
        "--limits.max-batch-tokens", "256", "--parallel.world-size", "2", "--model.cpu-threads", "1", *extra,
        timeout=240.0,
    )


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as fh:
            out += [int(c) for c in fh.read().split()]
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


async def test_two_rank_service(run_service, tiny_model: Path, tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    batch = fixed_batch()
    one = TrainingEngine(TrainerConfig.model_validate({
        "model": {"path": str(tiny_model)}, "optimizer": {"lr": 1e-3}, "limits": {"max_batch_tokens": 256}}))
    one.load()

    first = start(run_service, tiny_model, checkpoints)
    [rank1] = [p for p in children(first.process.pid) if "services.trainer.rank" in Path(f"/proc/{p}/cmdline").read_text()]
    async with TrainerClient(first.grpc_address, token=TEST_TOKEN, timeout=120) as trainer:
        info = await trainer.get_info()
        assert info.ready and info.parameter_count == one.info().parameter_count

        behaviour, version = await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"])
        expected, _ = one.compute_logprobs(batch)
        torch.testing.assert_close(behaviour, expected, rtol=1e-5, atol=1e-5)
        train_batch = make_train_batch(**batch, behaviour_logprobs=behaviour * batch["loss_mask"])
        plain = {**batch, "behaviour_logprobs": behaviour * batch["loss_mask"]}

        losses = []
        for step in range(1, 4):
            result = await trainer.train_step(train_batch, LOSS, micro_batch_size=1, expected_step=step - 1)
            reference = one.train_step(plain, LossRequest(kind="grpo", is_cap=2.0), micro_batch_size=1)
            assert (result.step, result.weight_version) == (step, step)
            assert result.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5, abs=1e-7)
            losses.append(result.metrics["loss"])

        # Refused on rank 0 before any rank moves; the ranks stay in step.
        bad = make_train_batch(**{**batch, "loss_mask": batch["loss_mask"][:, :-1]}, behaviour_logprobs=behaviour)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await trainer.train_step(bad, LOSS)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "batch.loss_mask" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await trainer.optim_step()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        saved = await trainer.save_checkpoint(client_state=b"cursor")
        assert saved.step == 3
        state = json.loads((Path(saved.path) / "trainer_state.json").read_text())
        assert state["world_size"] == 2
        uninterrupted = [(await trainer.train_step(train_batch, LOSS, micro_batch_size=1)).metrics["loss"]
                         for _ in range(2)]

        exported = await trainer.export_weights("checkpoint")
        assert exported.weight_version == 5
        live, _ = await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"])
    # The published version is an HF model directory of the live weights.
    model = AutoModelForCausalLM.from_pretrained(exported.path).eval()
    with torch.no_grad():
        offline, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(offline, live, rtol=1e-5, atol=1e-5)
    assert set(load_file(str(Path(saved.path) / "model" / "model.safetensors"))) == set(
        load_file(str(Path(exported.path) / "model.safetensors")))

    assert first.stop() == 0
    assert wait_gone(rank1, 30), "rank 1 outlived a graceful stop"

    second = start(run_service, tiny_model, checkpoints, "--checkpoint.resume-latest", "true")
    [rank1] = [p for p in children(second.process.pid) if "services.trainer.rank" in Path(f"/proc/{p}/cmdline").read_text()]
    async with TrainerClient(second.grpc_address, token=TEST_TOKEN, timeout=120) as trainer:
        assert (await trainer.get_info()).step == 3
        resumed = [(await trainer.train_step(train_batch, LOSS, micro_batch_size=1)).metrics["loss"] for _ in range(2)]
    assert resumed == uninterrupted
    # A killed service (no graceful stop) takes its rank with it.
    second.process.kill()
    second.process.wait()
    assert wait_gone(rank1, 30), "rank 1 outlived its killed service"
