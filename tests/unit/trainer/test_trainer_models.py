"""Several LoRA models on one trainer (SelectModel/DropModel): each keeps its own adapters, gradients,
optimizer moments, step and weight version, whatever order their calls interleave in."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flywheel.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.trainer.training import LossRequest
from tests.unit.trainer.trainer_helpers import make_batch, optimizer_state, same_tensors

GRPO = LossRequest(kind="grpo")
LORA = {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}}


def adapters(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.policy.model.named_parameters() if p.requires_grad}


def train_alone(make_engine, batch: dict, steps: int):
    engine = make_engine(model=LORA)
    for _ in range(steps):
        engine.forward_backward(batch, GRPO)
        engine.optim_step()
    return engine


def test_interleaved_models_train_exactly_as_each_would_alone(make_engine) -> None:
    batch_a, batch_b = make_batch(seed=1), make_batch(seed=2)
    shared = make_engine(model=LORA)
    assert shared.select_model("a") == (True, 0)
    for _ in range(2):
        # a's gradients are accumulated but not applied when b takes the trainer, and b's steps are taken
        # in between: neither may leak into the other.
        shared.select_model("a")
        shared.forward_backward(batch_a, GRPO)
        assert shared.select_model("b")[1] in (0, 1)
        shared.forward_backward(batch_b, GRPO)
        shared.optim_step()
        shared.select_model("a")
        shared.optim_step()
    alone_a, alone_b = train_alone(make_engine, batch_a, 2), train_alone(make_engine, batch_b, 2)
    shared.select_model("a")
    assert same_tensors(adapters(shared), adapters(alone_a))
    assert same_tensors(optimizer_state(shared), optimizer_state(alone_a))
    # Each model counts its own steps; a weight version names one set of weights whichever model made it.
    assert (shared.info().step, shared.info().weight_version) == (2, 4)
    shared.select_model("b")
    assert same_tensors(adapters(shared), adapters(alone_b))
    assert (shared.info().step, shared.info().weight_version) == (2, 3)
    assert not same_tensors(adapters(alone_a), adapters(alone_b))  # the comparison can tell them apart
    assert shared.info().model_ids == ("b", "", "a")


def test_a_new_model_starts_from_the_initial_adapters_and_the_trainers_own_keeps_its_state(make_engine) -> None:
    engine = make_engine(model=LORA)
    initial = adapters(engine)
    engine.forward_backward(make_batch(), GRPO)
    engine.optim_step()
    trained = adapters(engine)
    assert not same_tensors(trained, initial)
    assert engine.select_model("fresh") == (True, 0)
    assert same_tensors(adapters(engine), initial) and not engine.policy.has_gradients()
    assert engine.select_model("") == (False, 1)
    assert same_tensors(adapters(engine), trained)


def test_a_checkpoint_loads_into_the_selected_model_only(make_engine, tmp_path) -> None:
    engine = make_engine(model=LORA)
    engine.select_model("a")
    engine.forward_backward(make_batch(), GRPO)
    engine.optim_step()
    path, step, _ = engine.save_checkpoint(tmp_path / "ckpt" / "a")
    saved_a = adapters(engine)
    engine.select_model("b")
    untouched = adapters(engine)
    engine.select_model("c")
    engine.load_checkpoint(path)
    assert same_tensors(adapters(engine), saved_a) and engine.info().step == step == 1
    engine.select_model("b")
    assert same_tensors(adapters(engine), untouched) and engine.info().step == 0
    # A version names one set of weights: b's next step is numbered past the loaded model's version too.
    loaded_version = 7
    engine.select_model("c")
    engine.policy.weight_version = loaded_version  # as a checkpoint from a longer run would set it
    engine.select_model("b")
    engine.forward_backward(make_batch(), GRPO)
    assert engine.optim_step().weight_version == loaded_version + 1


def test_what_cannot_hold_several_models_is_refused(make_engine) -> None:
    with pytest.raises(FailedPrecondition, match="LoRA"):
        make_engine().select_model("a")
    engine = make_engine(model=LORA, limits={"max_models": 3})
    engine.select_model("a")
    engine.select_model("b")
    with pytest.raises(ResourceExhausted, match="max_models"):
        engine.select_model("c")
    assert engine.info().model_ids[0] == "b"  # the refused select changed nothing
    with pytest.raises(FailedPrecondition, match="selected"):
        engine.drop_model("b")
    with pytest.raises(NotFound):
        engine.drop_model("nobody")
    engine.drop_model("a")
    assert engine.select_model("c") == (True, 0)
    assert set(engine.info().model_ids) == {"c", "b", ""}


async def test_a_trainer_that_publishes_to_a_synchronizer_trains_its_own_model_only(make_engine) -> None:
    from flywheel.trainer.v1 import trainer_pb2 as pb
    from services.trainer.servicer import TrainerServicer

    engine = make_engine(model=LORA)
    servicer = TrainerServicer(engine)
    selected = await servicer.SelectModel(pb.SelectModelRequest(model_id="a"), None)
    assert selected.created and selected.step == 0
    engine.lock.acquire()  # a long step in progress: selecting the selected model does not wait for it
    try:
        again = await asyncio.wait_for(servicer.SelectModel(pb.SelectModelRequest(model_id="a"), None), timeout=2)
    finally:
        engine.lock.release()
    assert not again.created
    info = await servicer.GetInfo(pb.GetInfoRequest(), None)
    assert list(info.model_ids) == ["a", ""]

    async def publish() -> None: ...

    servicer.after_step = publish  # linked: every step is published to the synchronizer's one version line
    with pytest.raises(FailedPrecondition, match="synchronizer"):
        await servicer.SelectModel(pb.SelectModelRequest(model_id="b"), None)
    await servicer.SelectModel(pb.SelectModelRequest(model_id=""), None)  # its own: allowed
    await servicer.DropModel(pb.DropModelRequest(model_id="a"), None)
    assert list((await servicer.GetInfo(pb.GetInfoRequest(), None)).model_ids) == [""]
