"""The trainer's turns go round the tenants that wait: one tenant's many models or long queue does not hold up
another's requests, first come first served within a tenant, and a waiter that gives up leaves the line."""

from __future__ import annotations

import asyncio

import pytest

from services.tinker.futures import Futures, Outcome
from services.tinker.models import TrainingModel, TrainingModels
from services.tinker.turns import FairTurns
from tests.unit.tinker.test_tinker_models import FakeTrainer


async def take(turns: FairTurns, tenant: str, label: str, order: list[str], hold: float = 0.0) -> None:
    async with turns.turn(tenant):
        order.append(label)
        await asyncio.sleep(hold)


async def test_a_tenant_that_asks_later_is_not_behind_another_tenants_whole_queue() -> None:
    turns, order = FairTurns(), []
    first = asyncio.create_task(take(turns, "a", "a0", order, hold=0.05))
    await asyncio.sleep(0)
    burst = [asyncio.create_task(take(turns, "a", f"a{i}", order)) for i in range(1, 6)]
    await asyncio.sleep(0)
    late = [asyncio.create_task(take(turns, "b", f"b{i}", order)) for i in range(2)]
    await asyncio.gather(first, *burst, *late)
    # b asked after all of a's burst, and goes next (served least recently), then every other turn; each
    # tenant's own in the order they asked.
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert turns.taken == {"a": 6, "b": 2}


async def test_a_waiter_that_gives_up_leaves_the_line_and_the_turn_goes_on() -> None:
    turns, order = FairTurns(), []
    holder = asyncio.create_task(take(turns, "a", "a0", order, hold=0.05))
    await asyncio.sleep(0)
    quitter = asyncio.create_task(take(turns, "b", "b0", order))
    after = asyncio.create_task(take(turns, "c", "c0", order))
    await asyncio.sleep(0.01)
    quitter.cancel()
    await asyncio.gather(holder, after, return_exceptions=True)
    assert order == ["a0", "c0"]
    # Free again: the next caller gets the turn at once.
    await asyncio.wait_for(take(turns, "b", "b1", order), 1)
    assert order[-1] == "b1"


async def test_a_turn_granted_to_a_waiter_cancelled_at_that_moment_passes_on() -> None:
    turns, order, waiters = FairTurns(), [], []

    async def holder() -> None:
        async with turns.turn("a"):
            order.append("a0")
            await asyncio.sleep(0.02)
        waiters[0].cancel()  # b's waiter was given the turn as the block ended, and has not run yet

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiters.append(asyncio.create_task(take(turns, "b", "b0", order)))
    nextone = asyncio.create_task(take(turns, "c", "c0", order))
    await first
    await asyncio.wait_for(nextone, 1)
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert order == ["a0", "c0"]


async def test_models_of_a_tenant_with_many_do_not_crowd_out_a_tenant_with_one() -> None:
    futures, trainer = Futures(), FakeTrainer()
    models = TrainingModels(futures, trainer.select, trainer.drop)
    ran: list[str] = []
    for name, tenant in (("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob")):
        trainer.held.add(name)
        models.add(TrainingModel(name, "s-" + tenant, tenant, "base", 4))

    def work(name: str):
        async def run() -> Outcome:
            ran.append(name)
            await asyncio.sleep(0.001)
            return Outcome(json={})
        return run

    ids = [(tenant, models.submit(name, tenant, seq, "forward_backward", work(name)))
           for seq in (1, 2, 3) for name, tenant in (("a1", "alice"), ("a2", "alice"), ("a3", "alice"))]
    await asyncio.sleep(0)
    ids += [("bob", models.submit("b1", "bob", seq, "forward_backward", work("b1"))) for seq in (1, 2, 3)]
    for tenant, request_id in ids:
        assert (await futures.wait(request_id, tenant, 5)) is not None
    # Bob's three requests came after alice's nine, and took every other turn until they were done.
    assert [i for i, name in enumerate(ran) if name == "b1"] == [1, 3, 5], ran
    assert models.turns.taken["bob"] == 3 and models.turns.taken["alice"] == 9
    await models.close()
