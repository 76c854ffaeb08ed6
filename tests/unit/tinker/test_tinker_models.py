"""A model's requests run in seq_id order, each once, and models take turns on the trainer, each turn with
its own model selected there; a model the trainer lost is refused for good; sessions and models are their
tenant's; sessions end once and are forgotten later."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.tinker.futures import Futures, Outcome
from flywheel.trainer.types import LoraShape
from services.tinker.models import Sessions, TrainingModel, TrainingModels, lora_shape

T = "alice"  # the tenant of every session and model here, unless a test says otherwise


class FakeTrainer:
    """What the trainer's SelectModel/DropModel do, as far as the gateway can see."""

    def __init__(self) -> None:
        self.held, self.selected = {""}, ""
        self.calls: list[tuple[str, str]] = []

    async def select(self, model_id: str, shape: LoraShape = LoraShape()) -> bool:
        self.calls.append(("select", model_id))
        created = model_id not in self.held
        self.held.add(model_id)
        self.selected = model_id
        return created

    async def drop(self, model_id: str) -> None:
        self.calls.append(("drop", model_id))
        assert model_id != self.selected
        self.held.remove(model_id)


def models_with_m() -> tuple[Futures, TrainingModels]:
    """Fresh futures and models, with the tenant's model "m" (session "s", LoRA rank 4) held on the trainer."""
    futures, trainer = Futures(), FakeTrainer()
    trainer.held |= {"m"}
    models = TrainingModels(futures, trainer.select, trainer.drop)
    models.add(TrainingModel("m", "s", T, "base", 4))
    return futures, models


async def test_requests_run_in_seq_order_whatever_order_they_arrive_in_and_a_resend_runs_once() -> None:
    futures, models = models_with_m()
    ran: list[int] = []

    def work(seq: int):
        async def run() -> Outcome:
            ran.append(seq)
            await asyncio.sleep(0)
            return Outcome(json={"seq": seq})
        return run

    third = models.submit("m", T, 3, "forward_backward", work(3))
    second = models.submit("m", T, 2, "forward_backward", work(2))
    await asyncio.sleep(0.05)
    assert ran == []  # seq 1 has not come
    assert await futures.wait(third, T, 0.01) is None
    first = models.submit("m", T, 1, "forward_backward", work(1))
    assert models.submit("m", T, 2, "forward_backward", work(2)) == second  # the SDK's retry: the same request
    assert (await futures.wait(third, T, 5)).json == {"seq": 3}
    assert ran == [1, 2, 3]
    assert (await futures.wait(first, T, 1)).json == {"seq": 1} and (await futures.wait(second, T, 1)).json == {"seq": 2}
    assert models.submit("m", T, 1, "optim_step", work(1)) == first and ran == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="seq_id must be 1 or more"):
        models.submit("m", T, 0, "optim_step", work(0))
    with pytest.raises(NotFound, match="model 'other'"):
        models.submit("other", T, 4, "optim_step", work(4))
    await models.close()


async def test_a_request_refused_before_it_was_queued_does_not_hold_up_the_next_ones() -> None:
    futures, models = models_with_m()

    async def done() -> Outcome:
        return Outcome(json={})

    models.submit("m", T, 1, "forward_backward", done)
    third = models.submit("m", T, 3, "save_weights_for_sampler", done)
    await asyncio.sleep(0.05)
    assert await futures.wait(third, T, 0.01) is None  # seq 2 has not come...
    models.pass_over("m", "mallory", 2)  # ...and only the model's tenant may skip it
    models.pass_over("m", T, 1)  # nor is a number already queued skipped
    await asyncio.sleep(0.05)
    assert await futures.wait(third, T, 0.01) is None
    models.pass_over("m", T, 2)  # refused at the door (save_weights_external): the SDK numbered it all the same
    assert (await futures.wait(third, T, 5)).json == {}
    await models.close()


async def test_a_failed_request_answers_its_error_and_the_next_one_still_runs() -> None:
    futures, models = models_with_m()

    async def refused() -> Outcome:
        raise InvalidArgument("loss_fn 'ppo' is not served")

    async def broken() -> Outcome:
        raise RuntimeError("boom")

    async def fine() -> Outcome:
        return Outcome(json={"ok": True})

    ids = [models.submit("m", T, 1, "a", refused), models.submit("m", T, 2, "b", broken),
           models.submit("m", T, 3, "c", fine)]
    outcomes = [await futures.wait(i, T, 5) for i in ids]
    assert outcomes[0].reply() == {"error": "loss_fn 'ppo' is not served", "category": "user"}
    assert outcomes[1].reply()["category"] == "server" and "boom" in outcomes[1].reply()["error"]
    assert outcomes[2].reply() == {"ok": True}
    await models.close()


async def test_two_models_take_turns_each_with_itself_selected_and_a_retired_one_is_dropped() -> None:
    futures, trainer = Futures(), FakeTrainer()
    models = TrainingModels(futures, trainer.select, trainer.drop)
    for name in ("a", "b"):
        async with models.turn(name, T, new=True):
            models.add(TrainingModel(name, f"session-{name}", T, "base", 4))
    seen: list[tuple[str, str]] = []

    def work(name: str, seq: int):
        async def run() -> Outcome:
            seen.append((name, trainer.selected))
            await asyncio.sleep(0.01)  # the other model's request waits for this turn to end
            seen.append((name, trainer.selected))
            return Outcome(json={"seq": seq})
        return run

    ids = [models.submit(name, T, seq, "forward_backward", work(name, seq)) for seq in (1, 2) for name in ("a", "b")]
    assert [(await futures.wait(i, T, 5)).json for i in ids] == [{"seq": 1}, {"seq": 1}, {"seq": 2}, {"seq": 2}]
    assert all(name == selected for name, selected in seen)  # never another model's turn

    async def never() -> Outcome:
        raise AssertionError("a request of a retired model ran")

    waiting = models.submit("a", T, 4, "optim_step", never)  # seq 3 never came
    await models.retire(models.get("a", T), "its session finished (success)")
    assert "its session finished" in (await futures.wait(waiting, T, 1)).reply()["error"]
    assert trainer.held == {"", "b"} and trainer.calls[-2:] == [("select", ""), ("drop", "a")]
    with pytest.raises(FailedPrecondition, match="takes no more requests"):
        models.submit("a", T, 3, "optim_step", never)
    assert models.known("a") is not None and [m.model_id for m in models.training()] == ["b"]

    trainer.held.remove("b")  # the trainer restarted: it would create b afresh, from the initial adapters
    behind = models.submit("b", T, 4, "optim_step", never)  # pipelined behind the request that finds it lost
    lost = models.submit("b", T, 3, "forward_backward", never)
    assert "no longer holds model b" in (await futures.wait(lost, T, 5)).reply()["error"]
    assert "no longer holds model b" in (await futures.wait(behind, T, 5)).reply()["error"]
    assert "b" not in trainer.held  # the empty stand-in the trainer made was dropped at once
    with pytest.raises(FailedPrecondition, match="no longer holds model b"):  # and every later request refused
        models.submit("b", T, 5, "optim_step", never)
    trainer.held.add("c")
    with pytest.raises(AlreadyExists):
        async with models.turn("c", T, new=True):
            pass
    await models.close()


async def test_a_model_is_its_tenants_and_another_tenant_does_not_find_it() -> None:
    futures, models = models_with_m()

    async def fine() -> Outcome:
        return Outcome(json={"ok": True})

    with pytest.raises(NotFound, match="model 'm' is not known"):
        models.submit("m", "bob", 1, "optim_step", fine)
    request = models.submit("m", T, 1, "optim_step", fine)
    with pytest.raises(NotFound, match="is not known here"):
        await futures.wait(request, "bob", 1)
    with pytest.raises(NotFound):
        futures.cancel(request, "bob")
    with pytest.raises(InvalidArgument, match="optim_step request is not cancelled"):
        futures.cancel(request, T)
    assert (await futures.wait(request, T, 5)).json == {"ok": True}
    await models.close()


async def test_a_sample_is_cancelled_and_answers_so() -> None:
    futures = Futures()
    request = futures.new("sample", T)
    futures.run(request, lambda: asyncio.sleep(30))
    await asyncio.sleep(0)
    futures.cancel(request, T)
    assert (await futures.wait(request, T, 5)).reply() == {
        "error": f"request {request} was cancelled by the client", "category": "user"}


def test_a_session_ends_once_a_silent_one_expires_and_ended_ones_are_forgotten_later() -> None:
    sessions = Sessions(timeout_seconds=60, forget_seconds=100)
    session = sessions.create(T)
    sessions.heartbeat(session.session_id, T)
    with pytest.raises(NotFound):  # another tenant's session is not found
        sessions.heartbeat(session.session_id, "bob")
    sessions.finish(session.session_id, T, "success", None)
    sessions.finish(session.session_id, T, "errored", "late")
    assert (session.ended, session.detail) == ("success", None)  # the first reason stays
    with pytest.raises(FailedPrecondition, match="has finished"):
        sessions.heartbeat(session.session_id, T)
    silent = sessions.create(T)
    silent.last_heartbeat -= 61
    with pytest.raises(FailedPrecondition, match=r"has finished \(expired\)"):
        sessions.live(silent.session_id, T)
    assert sessions.forgettable() == []  # ended, not long enough ago
    session.ended_at -= 101
    assert sessions.forgettable() == [session.session_id]
    with pytest.raises(NotFound):
        sessions.get(session.session_id, T)


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@pytest.mark.parametrize("rank, flags, modules, message", [
    (8, {}, ALL, "from 1 to 4 .* got 8"),
    (0, {}, ALL, "from 1 to 4 .* got 0"),
    (4, {}, ("q_proj", "k_proj", "v_proj", "o_proj"), "train_mlp: the trainer has no adapters on down_proj"),
    (4, {"train_mlp": False}, ("q_proj", "lm_head"), "train_attn: the trainer has no adapters on k_proj"),
    (4, {"train_attn": False, "train_mlp": False, "train_unembed": False}, ALL, "nothing to train"),
])
def test_lora_settings_past_the_trainers_are_refused(rank, flags, modules, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        lora_shape(rank, flags, 4, modules)


def test_each_model_gets_its_own_rank_and_modules_within_the_trainers() -> None:
    assert lora_shape(4, {}, 4, ALL) == LoraShape(4, tuple(sorted(ALL)))
    # A smaller rank, and fewer modules than the trainer adapts: the model's own.
    assert lora_shape(2, {"train_mlp": False, "train_unembed": False}, 4, ("all-linear", "lm_head")) == \
        LoraShape(2, ("k_proj", "o_proj", "q_proj", "v_proj"))
    with pytest.raises(FailedPrecondition, match="trains every parameter"):
        lora_shape(4, {}, 0, ())
