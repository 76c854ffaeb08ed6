"""One rank under FSDP2 (`parallel.shard`): the path a single-GPU trainer takes.

Runs on CPU (gloo) everywhere; the CUDA cases (nccl, marked `gpu`) skip
without a GPU and run on the device machine. Two CUDA ranks run when the
machine has two GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.models.tiny import build_tiny_model
from services.trainer.config import TrainerConfig
from services.trainer.distributed import gather_buckets
from services.trainer.export import export_state
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine
from tests.unit.trainer.trainer_helpers import loaded_engine, make_batch

LOSS = LossRequest(kind="dapo", is_cap=2.0, entropy_coef=0.001)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda:0", id="cuda", marks=[pytest.mark.gpu, CUDA])]


def _config(model: Path, ckpt: Path, device: str, **parallel) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"path": str(model), "device": device},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "checkpoint": {"dir": str(ckpt)},
        "parallel": {"timeout_seconds": 300, **parallel},
    })


def _plain_state(e: TrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in export_state(e.policy, False).items()}


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_fsdp_step_equals_plain_step(device: str, tiny_model: Path, tmp_path: Path) -> None:
    batches = [make_batch(batch_size=4, seed=s) for s in range(3)]
    with loaded_engine(_config(tiny_model, tmp_path / "plain", device)) as plain, \
            loaded_engine(_config(tiny_model, tmp_path / "fsdp", device, shard=True)) as fsdp:
        assert fsdp.sharded and fsdp.policy.sharded and not plain.sharded
        with fsdp.lock:
            gathered = fsdp.gathered_state(1 << 16)
        expected = _plain_state(plain)
        assert list(gathered) == list(expected) and all(torch.equal(gathered[k], expected[k]) for k in expected)
        for batch in batches:
            a = plain.train_step(batch, LOSS, micro_batch_size=2)
            b = fsdp.train_step(batch, LOSS, micro_batch_size=2)
            assert b.step == a.step and b.loss_tokens == a.loss_tokens
            for key in ("loss", "grad_norm", "entropy"):
                assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
        with fsdp.lock:
            after = fsdp.gathered_state(1 << 16)
        for name, value in _plain_state(plain).items():
            if not name.endswith("k_proj.bias"):  # its gradient is rounding noise (see test_sharded_engine)
                torch.testing.assert_close(after[name], value, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_sharded_checkpoint_resumes_exactly(device: str, tiny_model: Path, tmp_path: Path) -> None:
    batches = [make_batch(batch_size=4, seed=s) for s in range(4)]
    config = _config(tiny_model, tmp_path / "ckpt", device, shard=True)
    with loaded_engine(config) as first:
        for batch in batches[:2]:
            first.train_step(batch, LOSS)
        path, _, _ = first.save_checkpoint()
        uninterrupted = [first.train_step(b, LOSS).metrics["loss"] for b in batches[2:]]
    with loaded_engine(config) as second:
        assert second.load_checkpoint(path)[1:3] == (2, 2)
        assert [second.train_step(b, LOSS).metrics["loss"] for b in batches[2:]] == uninterrupted


@pytest.mark.gpu
@CUDA
def test_export_gathers_one_parameter_at_a_time_on_the_gpu(tmp_path: Path) -> None:
    """No second copy of the model on the GPU: the export's peak is about one parameter."""
    deeper = build_tiny_model(tmp_path / "model", num_layers=6)  # the embedding is a tenth of the model
    with loaded_engine(_config(deeper, tmp_path / "ckpt", "cuda:0", shard=True)) as fsdp:
        fsdp.train_step(make_batch(batch_size=4), LOSS)
        model = fsdp.policy.model
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with fsdp.lock:
            total = sum(t.numel() * t.element_size() for b in gather_buckets(model, 1 << 16) for t in b.values())
        peak = torch.cuda.max_memory_allocated() - base
        assert total > 4 * largest and peak <= 2 * largest + (1 << 20), (peak, largest, total)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_cuda_ranks_step_like_one(tiny_model: Path, tmp_path: Path) -> None:
    batch = make_batch(batch_size=5)
    with loaded_engine(_config(tiny_model, tmp_path / "one", "cuda:0")) as one:
        a = one.train_step(batch, LOSS, micro_batch_size=2)
    with loaded_engine(_config(tiny_model, tmp_path / "two", "cuda", world_size=2)) as two:
        b = two.train_step(batch, LOSS, micro_batch_size=2)
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], rel=1e-4, abs=1e-6)
