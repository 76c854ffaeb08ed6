"""A model's requests run in seq_id order, each once; sessions end once."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.errors import FailedPrecondition, InvalidArgument, NotFound
from services.tinker.futures import Futures, Outcome
from services.tinker.models import Sessions, TrainingModel, TrainingModels, check_lora


async def test_requests_run_in_seq_order_whatever_order_they_arrive_in_and_a_resend_runs_once() -> None:
    futures = Futures()
    models = TrainingModels(futures)
    models.add(TrainingModel("m", "s", "base", 4))
    ran: list[int] = []

    def work(seq: int):
        async def run() -> Outcome:
            ran.append(seq)
            await asyncio.sleep(0)
            return Outcome(json={"seq": seq})
        return run

    third = models.submit("m", 3, "forward_backward", work(3))
    second = models.submit("m", 2, "forward_backward", work(2))
    await asyncio.sleep(0.05)
    assert ran == []  # seq 1 has not come
    assert await futures.wait(third, 0.01) is None
    first = models.submit("m", 1, "forward_backward", work(1))
    assert models.submit("m", 2, "forward_backward", work(2)) == second  # the SDK's retry: the same request
    assert (await futures.wait(third, 5)).json == {"seq": 3}
    assert ran == [1, 2, 3]
    assert (await futures.wait(first, 1)).json == {"seq": 1} and (await futures.wait(second, 1)).json == {"seq": 2}
    assert models.submit("m", 1, "optim_step", work(1)) == first and ran == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="seq_id must be 1 or more"):
        models.submit("m", 0, "optim_step", work(0))
    with pytest.raises(NotFound, match="model 'other'"):
        models.submit("other", 4, "optim_step", work(4))
    await models.close()


async def test_a_failed_request_answers_its_error_and_the_next_one_still_runs() -> None:
    futures = Futures()
    models = TrainingModels(futures)
    models.add(TrainingModel("m", "s", "base", 4))

    async def refused() -> Outcome:
        raise InvalidArgument("loss_fn 'ppo' is not served")

    async def broken() -> Outcome:
        raise RuntimeError("boom")

    async def fine() -> Outcome:
        return Outcome(json={"ok": True})

    ids = [models.submit("m", 1, "a", refused), models.submit("m", 2, "b", broken), models.submit("m", 3, "c", fine)]
    outcomes = [await futures.wait(i, 5) for i in ids]
    assert outcomes[0].reply() == {"error": "loss_fn 'ppo' is not served", "category": "user"}
    assert outcomes[1].reply()["category"] == "server" and "boom" in outcomes[1].reply()["error"]
    assert outcomes[2].reply() == {"ok": True}
    await models.close()


async def test_one_trainer_holds_one_model_while_its_session_runs() -> None:
    futures = Futures()
    models = TrainingModels(futures)
    models.check_free(holder_runs=True)  # nobody holds it yet
    models.add(TrainingModel("first", "s", "base", 4))
    with pytest.raises(FailedPrecondition, match="holds model first"):
        models.check_free(holder_runs=True)

    async def never() -> Outcome:
        raise AssertionError("a request of a model that gave the trainer away ran")

    waiting = models.submit("first", 2, "optim_step", never)  # seq 1 never came
    models.check_free(holder_runs=False)  # its session ended: a new model may take the trainer
    models.add(TrainingModel("second", "t", "base", 4))
    assert "gave the trainer to model second" in (await futures.wait(waiting, 1)).reply()["error"]
    with pytest.raises(FailedPrecondition, match="no longer holds the trainer"):
        models.submit("first", 3, "optim_step", never)
    assert models.known("first") is not None and models.get("second").model_id == "second"
    await models.close()


def test_a_session_ends_once_and_a_silent_one_expires(monkeypatch) -> None:
    sessions = Sessions(timeout_seconds=60)
    session = sessions.create()
    sessions.heartbeat(session.session_id)
    sessions.finish(session.session_id, "success", None)
    sessions.finish(session.session_id, "errored", "late")
    assert (session.ended, session.detail) == ("success", None)  # the first reason stays
    with pytest.raises(FailedPrecondition, match="has finished"):
        sessions.heartbeat(session.session_id)
    silent = sessions.create()
    silent.last_heartbeat -= 61
    with pytest.raises(FailedPrecondition, match=r"has finished \(expired\)"):
        sessions.live(silent.session_id)


@pytest.mark.parametrize("rank, flags, modules, message", [
    (8, {}, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"), "rank 4, not 8"),
    (4, {}, ("q_proj", "k_proj", "v_proj", "o_proj"), "train_mlp=True: the trainer has adapters on none"),
    (4, {"train_mlp": False, "train_unembed": False}, ("all-linear",), "train_mlp=False: the trainer has adapters on"),
    (4, {"train_mlp": False}, ("q_proj", "lm_head"), "train_attn=True: the trainer has adapters on q_proj of"),
])
def test_lora_settings_the_trainer_does_not_train_are_refused(rank, flags, modules, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_lora(rank, flags, 4, modules)


def test_lora_settings_the_trainer_trains_are_accepted() -> None:
    check_lora(4, {}, 4, ("all-linear", "lm_head"))
    check_lora(4, {"train_mlp": False, "train_unembed": False}, 4, ("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(FailedPrecondition, match="trains every parameter"):
        check_lora(4, {}, 0, ())
