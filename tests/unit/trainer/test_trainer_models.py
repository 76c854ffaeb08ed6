"""Several LoRA models on one trainer (SelectModel/DropModel): each keeps its own adapters, gradients,
optimizer moments, step and weight version, whatever order their calls interleave in."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.trainer.loss_request import LossRequest
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


def test_a_model_of_its_own_rank_and_modules_trains_exactly_a_lora_of_that_shape(make_engine, tiny_model,
                                                                                  tmp_path) -> None:
    """A rank-2 model on q_proj and v_proj, on a trainer of rank 4 on the attention's four projections: its
    adapters past its rank and modules stay zero through training (weight decay on), it is scaled as a
    rank-2 LoRA, and the adapter it exports, loaded into peft as a rank-2 LoRA of those modules, computes
    exactly what the trainer trains. A save of it, loaded into a new model, brings its shape along."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from flywheel.trainer.types import LoraShape
    from services.trainer.export import export_state

    engine = make_engine(model=LORA)
    shape = LoraShape(2, ("q_proj", "v_proj"))
    assert engine.select_model("small", shape) == (True, 0)
    for seed in range(3):
        engine.forward_backward(make_batch(seed=seed), GRPO)
        engine.optim_step()
    layers = engine.policy._lora_layers()
    for short, module in layers:
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        assert module.scaling["default"] == 8.0 / 2
        if short in shape.modules:
            assert not a[2:].any() and not b[:, 2:].any()
            assert a[:2].any() and b[:, :2].any()  # trained, not left at zero
        else:
            assert not a.any() and not b.any()
    exported = export_state(engine.policy, merge_lora=False)
    assert exported and all(t.shape[0] == 2 for n, t in exported.items() if ".lora_A." in n)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in exported} == set(shape.modules)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=8.0, target_modules=list(shape.modules)))
    set_peft_model_state_dict(peft, exported)
    ids = torch.randint(3, 200, (2, 12))
    with torch.no_grad():
        ours = engine.policy.model(input_ids=ids).logits
        theirs = peft(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
    # Another model keeps the trainer's own scale; back to "small", its own again.
    engine.select_model("")
    assert all(module.scaling["default"] == 8.0 / 4 for _, module in layers)
    engine.select_model("small")
    assert all(module.scaling["default"] == 8.0 / 2 for _, module in layers)
    path, _, _ = engine.save_checkpoint(tmp_path / "ckpt" / "small")
    engine.select_model("again")
    assert engine.policy.shape == engine.policy.full_shape
    engine.load_checkpoint(path)
    assert engine.policy.shape == shape and all(module.scaling["default"] == 8.0 / 2 for _, module in layers)
    with torch.no_grad():
        assert torch.equal(engine.policy.model(input_ids=ids).logits, ours)
    with pytest.raises(InvalidArgument, match="rank 4, the most"):
        engine.select_model("big", LoraShape(8, ()))
    with pytest.raises(InvalidArgument, match="gate_proj"):
        engine.select_model("mlp", LoraShape(2, ("gate_proj",)))
