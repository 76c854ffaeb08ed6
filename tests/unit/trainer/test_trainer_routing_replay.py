"""Mixture-of-experts routing replay on the tiny Qwen3-MoE: the rollout's recorded experts replace the
trainer's top-k (the gate weights still from its own logits), the flips are counted, and replay closes
the trainer-rollout gap that bfloat16 autocast opens against a float32 engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.errors import InvalidArgument
from flywheel.models.moe import NO_EXPERT, Recorder, RoutingStats, compact, routers, routing_shape
from flywheel.models.tiny import build_tiny_model
from services.trainer.config import TrainerConfig
from services.trainer.forward import token_logprobs
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # init std 0.05: the experts' outputs matter next to bfloat16's rounding of the dense layers (bench/routing_replay.py)
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", init_std=0.05)


@pytest.fixture(scope="module")
def recorded(moe_model: Path):
    """A float32 forward's log-probs of 8 random rows and the routing it chose (what the rollout records)."""
    model = AutoModelForCausalLM.from_pretrained(moe_model).eval()
    ids = torch.randint(1, model.config.vocab_size, (8, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Recorder(model) as recorder:
        logprobs = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        routed = recorder.take().reshape(8, 48, 2, 2)
    return model, ids, logprobs, routed


def test_the_tiny_moe_is_qwen3_moe_with_its_experts_as_the_model_holds_them(moe_model: Path, recorded) -> None:
    model = recorded[0]
    assert model.config.model_type == "qwen3_moe"
    assert routing_shape(model).layers == 2 and routing_shape(model).top_k == 2 and routing_shape(model).num_experts == 8
    from safetensors import safe_open

    with safe_open(moe_model / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # The checkpoint's names are the state dict's: what the trainer publishes fits what a rollout loaded.
    assert names == {k for k in model.state_dict() if k != "lm_head.weight"}


def test_replay_uses_the_recorded_experts_and_the_router_still_learns(recorded) -> None:
    model, ids, reference, routed = recorded
    mask = torch.ones_like(ids)
    with torch.no_grad():
        same, _ = token_logprobs(model, ids, mask, routing=routed)
        assert torch.allclose(same[:, 1:], reference, atol=1e-5)
        other = (routed + 1) % 8  # every token through other experts
        moved, _ = token_logprobs(model, ids, mask, routing=other)
        assert (moved[:, 1:] - reference).abs().max() > 1e-3
        off, _ = token_logprobs(model, ids, mask, routing=other, replay=False)  # the setting off: routed anew
        assert torch.allclose(off[:, 1:], reference, atol=1e-5)
        # Rows without a record are routed by the trainer.
        partial = other.clone()
        partial[4:] = NO_EXPERT
        mixed, _ = token_logprobs(model, ids, mask, routing=partial)
        assert torch.allclose(mixed[4:, 1:], reference[4:], atol=1e-5)
        assert (mixed[:4, 1:] - reference[:4]).abs().max() > 1e-3
    model.zero_grad()
    lp, _ = token_logprobs(model, ids, mask, routing=other)
    lp.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_bfloat16_autocast_flips_routing_and_replay_closes_the_gap(recorded) -> None:
    model, ids, reference, routed = recorded
    mask = torch.ones_like(ids)
    kl, flips = {}, {}
    with torch.no_grad():
        for replay in (False, True):
            stats = RoutingStats()
            lp, _ = token_logprobs(model, ids, mask, autocast=torch.bfloat16, routing=routed, replay=replay,
                                   routing_stats=stats)
            log_ratio = lp[:, 1:] - reference
            kl[replay] = float((log_ratio.exp() - 1 - log_ratio).mean())
            flips[replay] = stats
    assert flips[False].decisions == 8 * 48 * 2 * 2
    assert 0 < flips[False].flip_fraction < 0.05, flips[False]
    assert kl[True] <= 0.1 * kl[False], kl


def test_the_trainer_replays_a_batchs_routing_and_reports_its_flips(moe_model: Path, recorded, tmp_path: Path) -> None:
    model, ids, reference, routed = recorded
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, 16:] = 1
    tensors = {"input_ids": ids, "loss_mask": mask, "advantages": torch.zeros(8),
               "behaviour_logprobs": torch.nn.functional.pad(reference, (1, 0)) * mask,
               "routed_experts": compact(routed, routing_shape(model))}
    results = {}
    for replay in (True, False):
        engine = TrainingEngine(TrainerConfig.model_validate({
            "model": {"path": str(moe_model), "autocast": "bfloat16", "routing_replay": replay},
            "checkpoint": {"dir": str(tmp_path / "ckpt")}}))
        engine.load()
        results[replay] = engine.forward_backward(tensors, LossRequest(kind="importance_sampling"), forward_only=True)
    for out in results.values():
        assert 0 < out.metrics["routing_flip_fraction"] < 0.05
        assert out.metrics["routing_decisions"] == 8 * 48 * 2 * 2  # every recorded position, layer and slot
    gap = {replay: float((out.logprobs[:, 1:] - reference)[mask[:, 1:] > 0].abs().mean())
           for replay, out in results.items()}
    assert gap[True] < gap[False]


def test_routing_of_the_wrong_shape_is_refused(moe_model: Path, tmp_path: Path) -> None:
    engine = TrainingEngine(TrainerConfig.model_validate({"model": {"path": str(moe_model)},
                                                          "checkpoint": {"dir": str(tmp_path / "ckpt")}}))
    engine.load()
    ids = torch.randint(1, 100, (2, 8))
    mask = torch.ones(2, 8)
    mask[:, 0] = 0
    base = {"input_ids": ids, "loss_mask": mask, "advantages": torch.zeros(2), "behaviour_logprobs": -mask}
    with pytest.raises(InvalidArgument, match="routed_experts: shape"):
        engine.forward_backward({**base, "routed_experts": torch.zeros(2, 7, 2, 2, dtype=torch.uint8)},
                                LossRequest(kind="importance_sampling"), forward_only=True)
    with pytest.raises(InvalidArgument, match="does not fit a model with 2 MoE layers"):
        engine.forward_backward({**base, "routed_experts": torch.zeros(2, 8, 3, 2, dtype=torch.uint8)},
                                LossRequest(kind="importance_sampling"), forward_only=True)
