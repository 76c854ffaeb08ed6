"""`model.compile`: each decoder layer's forward compiled (services.trainer.compiled).

On CPU the capture is checked with torch's "aot_eager" backend (dynamo's graphs and AOT
autograd, eager kernels): inductor's C++ build costs about a minute a graph on these
machines. The CUDA cases (marked `gpu`) compile with inductor, as a user's trainer does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import services.trainer.compiled as compiled
from flywheel.errors import FailedPrecondition
from flywheel.models.tiny import build_tiny_model
from services.trainer.config import TrainerConfig
from services.trainer.distributed import decoder_layers
from services.trainer.export import export_state
from services.trainer.loss_request import LossRequest
from tests.unit.trainer.trainer_helpers import loaded_engine, make_batch

LOSS = LossRequest(kind="dapo", is_cap=2.0, entropy_coef=0.001)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [
    pytest.param("cpu", {}, {}, id="cpu"),
    pytest.param("cpu", {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}}, {}, id="cpu-lora"),
    pytest.param("cpu", {}, {"shard": True}, id="cpu-fsdp"),
    pytest.param("cuda:0", {}, {}, id="cuda", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda:0", {}, {"shard": True}, id="cuda-fsdp", marks=[pytest.mark.gpu, CUDA]),
]


def _config(model: Path, ckpt: Path, device: str, compile: bool, model_extra: dict, parallel: dict) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"path": str(model), "device": device, "compile": compile, **model_extra},
        # eps well above rounding noise: see test_trainer_engine's micro-batch test.
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6},
        "checkpoint": {"dir": str(ckpt)},
        "parallel": {"timeout_seconds": 300, **parallel},
    })


def _batches() -> list[dict]:
    """GRPO groups (their prompt computed once, through a KV cache), then a ragged batch of another size
    (a second shape: the layers recompile with dynamic sizes)."""
    grouped = make_batch(batch_size=6, seq_len=16, prompt_len=9)
    for first in (0, 3):
        grouped["input_ids"][first:first + 3, :9] = grouped["input_ids"][first, :9]
    return [grouped, make_batch(batch_size=5, seq_len=20, seed=2)]


@pytest.mark.parametrize(("device", "model_extra", "parallel"), CASES)
def test_compiled_layers_take_the_steps_eager_layers_take(device: str, model_extra: dict, parallel: dict,
                                                          tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    if device == "cpu":
        monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    # The eager side unsharded: one process holds one default process group (a one-rank FSDP2 step equals
    # the plain one: test_sharded_one_rank).
    with loaded_engine(_config(tiny_model, tmp_path / "eager", device, False, model_extra, {})) as eager, \
            loaded_engine(_config(tiny_model, tmp_path / "compiled", device, True, model_extra, parallel)) as fast:
        layers = decoder_layers(fast.policy.model)
        assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
        assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in decoder_layers(eager.policy.model))
        for batch in _batches():
            a = eager.train_step(batch, LOSS, micro_batch_size=4)
            b = fast.train_step(batch, LOSS, micro_batch_size=4)
            assert b.step == a.step and b.loss_tokens == a.loss_tokens
            for key in ("loss", "grad_norm", "entropy"):
                assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-5), key
        # The layers ran as captured graphs, not eagerly after a failed capture.
        assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
        with fast.lock:
            got = fast.gathered_state(1 << 16) if fast.sharded else export_state(fast.policy, False)
        want = export_state(eager.policy, False)
        # The same names (what checkpoints, exports and digests use), and the same weights after two steps.
        assert list(got) == list(want)
        for name, value in want.items():
            if not name.endswith("k_proj.bias"):  # its gradient is rounding noise (see test_sharded_engine)
                assert torch.allclose(got[name].float().cpu(), value.float().cpu(), atol=5e-5), name


def test_compile_refuses_a_mixture_of_experts_model(tmp_path: Path) -> None:
    moe = build_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    with pytest.raises(FailedPrecondition, match="model.compile: not supported for mixture-of-experts"):
        with loaded_engine(_config(moe, tmp_path / "ckpt", "cpu", True, {}, {})):
            pass
