"""The gateway waits for its trainer and rollout at start (pods start in no order), within a deadline, and
drops the models an earlier gateway left on the trainer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from flywheel.errors import FailedPrecondition
from services.tinker import gateway as gateway_module
from services.tinker.config import TinkerConfig
from services.tinker.gateway import Gateway


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="connection refused")


class Answers:
    """A client method answering from a script (an exception is raised)."""

    def __init__(self, *answers) -> None:
        self.answers, self.calls = list(answers), 0

    async def __call__(self, *_, **__) -> object:
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def info(ready: bool, step: int = 0, model_ids=("",)):
    return SimpleNamespace(ready=ready, model_name="base", lora_rank=4, lora_target_modules=["q_proj"], step=step,
                           weight_version=step, model_ids=list(model_ids))


@pytest.fixture
def no_waiting(monkeypatch):
    real_sleep = asyncio.sleep
    monkeypatch.setattr(gateway_module.asyncio, "sleep", lambda seconds: real_sleep(0))


async def test_the_gateway_waits_for_a_trainer_that_is_down_then_loading(no_waiting, tmp_path) -> None:
    trainer = SimpleNamespace(get_info=Answers(unavailable(), info(False), info(True)))
    rollout = SimpleNamespace(status=Answers(unavailable(), SimpleNamespace(weight_version=0, max_resident_adapters=0)))
    gateway = Gateway(TinkerConfig(checkpoint_dir=tmp_path, rollout_address="r:1"), trainer, rollout)
    await gateway.start()
    assert trainer.get_info.calls == 3 and rollout.status.calls == 2
    assert (gateway.base_model, gateway.lora_rank) == ("base", 4)


async def test_a_trainer_that_never_comes_fails_the_start_naming_it(no_waiting, tmp_path) -> None:
    trainer = SimpleNamespace(get_info=Answers(unavailable()))
    gateway = Gateway(TinkerConfig(checkpoint_dir=tmp_path, trainer_address="t:1", wait_seconds=0.01), trainer)
    with pytest.raises(FailedPrecondition, match=r"trainer t:1 did not come up within wait_seconds=0.01.*answer"):
        await gateway.start()


async def test_models_an_earlier_gateway_left_on_the_trainer_are_dropped(no_waiting, tmp_path) -> None:
    calls: list[tuple[str, str]] = []

    async def select(model_id: str, **_) -> bool:
        calls.append(("select", model_id))
        return False

    async def drop(model_id: str, **_) -> None:
        calls.append(("drop", model_id))

    trainer = SimpleNamespace(get_info=Answers(info(True, step=3, model_ids=("s1:train:0", "", "s2:train:0"))),
                              select_model=select, drop_model=drop)
    await Gateway(TinkerConfig(checkpoint_dir=tmp_path), trainer).start()
    # their sessions went with that gateway: nobody can reach them, and each holds memory on the trainer
    assert calls == [("select", ""), ("drop", "s1:train:0"), ("drop", "s2:train:0")]
