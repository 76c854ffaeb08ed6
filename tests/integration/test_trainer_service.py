"""The trainer as a real process over real gRPC, on a tiny model.

One run trains 30 steps on a fixed batch and checks that learning happens;
a checkpoint taken at step 10 is loaded by a second process after the first
is killed, and must reproduce the uninterrupted run's next losses; the saved
model directory loads with `from_pretrained`; bad batches are rejected with
the right status and leave the parameters bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flywheel.common.v1 import common_pb2
from flywheel.models.tiny import build_tiny_model
from flywheel.trainer.v1 import trainer_pb2
from flywheel.trainer.client import TrainerClient, make_loss_spec, make_train_batch
from services.trainer.forward import token_logprobs
from tests.conftest import TEST_TOKEN

pytestmark = pytest.mark.slow

PROMPT_LEN, SEQ_LEN = 6, 20
LOSS = make_loss_spec("grpo", is_cap=2.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def fixed_batch() -> dict[str, torch.Tensor]:
    """One prompt, two completions (the second one shorter, right-padded)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 700, (PROMPT_LEN,), generator=g)
    ids = torch.stack([torch.cat([prompt, torch.randint(3, 700, (SEQ_LEN - PROMPT_LEN,), generator=g)]) for _ in range(2)])
    attention = torch.ones(2, SEQ_LEN, dtype=torch.int64)
    attention[1, -4:] = 0
    ids = ids * attention
    loss_mask = torch.zeros(2, SEQ_LEN)
    loss_mask[:, PROMPT_LEN:] = 1.0
    loss_mask *= attention
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
            "advantages": torch.tensor([1.0, -1.0]), "weight_versions": torch.zeros(2, dtype=torch.int64)}


def completion_logprob(logprobs: torch.Tensor, batch: dict) -> torch.Tensor:
    return (logprobs * batch["loss_mask"]).sum(dim=1)


def start(run_service, model: Path, checkpoints: Path):
    return run_service(
        "trainer", "--model.path", str(model), "--checkpoint.dir", str(checkpoints),
        "--optimizer.lr", "1e-3", "--limits.max-batch-tokens", "256",
    )


async def expect_error(call, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details(), info.value.details()


async def test_train_resume_export_and_reject(run_service, tiny_model: Path, tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    batch = fixed_batch()
    first = start(run_service, tiny_model, checkpoints)
    async with TrainerClient(first.grpc_address, token=TEST_TOKEN, timeout=60) as trainer:
        info = await trainer.get_info()
        assert info.ready and info.step == 0 and info.dtype == common_pb2.DTYPE_FLOAT32
        assert info.parameter_count == info.trainable_parameter_count > 0

        behaviour, version = await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"])
        assert version == 0
        start_lp = completion_logprob(behaviour, batch)
        train_batch = make_train_batch(**batch, behaviour_logprobs=behaviour * batch["loss_mask"])

        losses, saved = [], None
        for step in range(1, 31):
            result = await trainer.train_step(train_batch, LOSS, micro_batch_size=1, expected_step=step - 1)
            assert (result.step, result.weight_version) == (step, step)
            losses.append(result.metrics["loss"])
            if step == 10:
                saved = await trainer.save_checkpoint(client_state=b"data-cursor")
        end_lp = completion_logprob((await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"]))[0], batch)
    first.process.kill()  # no graceful shutdown: a crash
    first.process.wait()

    # Learning: the positive-advantage completion became likelier, the other less likely.
    assert end_lp[0] > start_lp[0] + 1.0 and end_lp[1] < start_lp[1] - 1.0
    assert losses[-1] < losses[0] - 0.5
    assert saved is not None and saved.step == 10 and Path(saved.path).name == "global_step_10"

    second = start(run_service, tiny_model, checkpoints)
    async with TrainerClient(second.grpc_address, token=TEST_TOKEN, timeout=60) as trainer:
        loaded = await trainer.load_checkpoint(latest=True)
        assert (loaded.path, loaded.step, loaded.weight_version, loaded.client_state) == (
            saved.path, 10, 10, b"data-cursor")
        live, _ = await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"])

        # The checkpoint is a plain HF model directory.
        model = AutoModelForCausalLM.from_pretrained(Path(saved.path) / "model").eval()
        with torch.no_grad():
            offline, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
        assert torch.allclose(offline, live, atol=1e-6)

        # Bad input: rejected with a message naming the field, nothing changes.
        # Paths stay inside the checkpoint directory: a relative one is taken there, one outside is refused.
        await expect_error(trainer.save_checkpoint(str(tmp_path / "outside")), grpc.StatusCode.PERMISSION_DENIED,
                           "outside the directories")
        await expect_error(trainer.load_checkpoint("../../etc"), grpc.StatusCode.PERMISSION_DENIED, "path")
        await expect_error(trainer.save_checkpoint("bad\0dir"), grpc.StatusCode.INVALID_ARGUMENT, "NUL")
        assert not (tmp_path / "outside").exists()
        before = await trainer.save_checkpoint("before")
        nan_adv = make_train_batch(**{**batch, "advantages": torch.tensor([1.0, float("nan")])},
                                   behaviour_logprobs=behaviour)
        short_mask = make_train_batch(**{**batch, "loss_mask": batch["loss_mask"][:, :-1]}, behaviour_logprobs=behaviour)
        truncated = make_train_batch(**batch, behaviour_logprobs=behaviour)
        truncated.input_ids.data = truncated.input_ids.data[:-8]
        empty = make_train_batch(torch.zeros(0, SEQ_LEN, dtype=torch.int64), loss_mask=torch.zeros(0, SEQ_LEN),
                                 advantages=torch.zeros(0), behaviour_logprobs=torch.zeros(0, SEQ_LEN))
        big = {k: v.repeat(8, *([1] * (v.dim() - 1))) for k, v in batch.items()}  # 16 x 20 > 256 tokens
        too_big = make_train_batch(**big, behaviour_logprobs=behaviour.repeat(8, 1))
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        await expect_error(trainer.train_step(nan_adv, LOSS), invalid, "batch.advantages")
        await expect_error(trainer.forward_backward(short_mask, LOSS), invalid, "batch.loss_mask")
        await expect_error(trainer.train_step(truncated, LOSS), invalid, "batch.input_ids")
        await expect_error(trainer.train_step(empty, LOSS), invalid, "batch.input_ids: the batch is empty")
        await expect_error(trainer.train_step(too_big, LOSS), invalid, "max_batch_tokens")
        await expect_error(trainer.train_step(train_batch, LOSS, expected_step=3),
                           grpc.StatusCode.FAILED_PRECONDITION, "expected_step")
        await expect_error(trainer.optim_step(), grpc.StatusCode.FAILED_PRECONDITION, "no accumulated gradients")
        after = await trainer.save_checkpoint("after")
        assert before.step == after.step == 10
        for name in ("model/model.safetensors",):
            a, b = load_file(Path(before.path) / name), load_file(Path(after.path) / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        opt_a = torch.load(Path(before.path) / "optimizer.pt", weights_only=True)["state"]
        opt_b = torch.load(Path(after.path) / "optimizer.pt", weights_only=True)["state"]
        assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])

        # The resumed run continues exactly where the killed one was.
        for step in (11, 12):
            result = await trainer.train_step(train_batch, LOSS, micro_batch_size=1, expected_step=step - 1)
            assert result.step == step
            assert result.metrics["loss"] == pytest.approx(losses[step - 1], abs=1e-6)
        assert (await trainer.get_info()).weight_version == 12

        # ForwardBackward hands back each datum's log-probs of its own forward pass (Tinker's per-datum
        # "logprobs"): what ComputeLogprobs gives on the same weights, at the loss mask's positions.
        current, _ = await trainer.compute_logprobs(batch["input_ids"], batch["attention_mask"])
        accumulated = await trainer.forward_backward(train_batch, LOSS, expected_step=12)
        mask = batch["loss_mask"].bool()
        assert accumulated.logprobs is not None and accumulated.logprobs.shape == mask.shape
        assert torch.allclose(accumulated.logprobs[mask], current[mask], atol=1e-5)
        assert not accumulated.logprobs[~mask].any()
        assert (await trainer.optim_step(expected_step=12)).step == 13

        # An export request without a method is rejected, naming the field.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await trainer.stub.ExportWeights(trainer_pb2.ExportWeightsRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "method" in info.value.details()
