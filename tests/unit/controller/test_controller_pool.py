"""Trajectory stores and the bounded, per-tag pool."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.batches.pool import GroupedStore, HierarchicalStore, PoolInstance, SimpleStore, TrajectoryPool, make_store
from tests.unit.controller.controller_helpers import task, trajectory


def test_simple_store_is_fifo_of_single_trajectories() -> None:
    store = SimpleStore()
    ts = [trajectory(task(i)) for i in range(3)]
    for t in ts:
        store.add(t)
    assert store.ready() == 3 and len(store) == 3
    assert store.take(2) == [[ts[0]], [ts[1]]]
    assert store.take_unit() == [ts[2]] and store.take_unit() is None


def test_grouped_store_releases_a_group_when_it_reaches_group_size() -> None:
    store = GroupedStore("task", group_size=3)
    a, b = task(1), task(2)
    store.add(trajectory(a))
    store.add(trajectory(b))
    store.add(trajectory(a))
    assert store.ready() == 0 and store.waiting() == 3
    store.add(trajectory(a))
    assert store.ready() == 3 and store.waiting() == 1
    group = store.take_unit()
    assert [t.task.id for t in group] == [a.id] * 3
    assert [t.task.id for t in store.drain_waiting()] == [b.id] and len(store) == 0


def test_grouped_store_by_a_row_field() -> None:
    store = make_store("grouped", ["topic"], 2)
    for i, topic in enumerate(["x", "y", "x"]):
        store.add(trajectory(task(i), topic=topic))
    assert [t.keys["topic"] for t in store.take_unit()] == ["x", "x"]


def test_hierarchical_store_groups_by_several_keys() -> None:
    store = HierarchicalStore(["task", "turn"], group_size=2)
    a, b = task(1), task(2)
    store.add(trajectory(a, turn=1))
    store.add(trajectory(a, turn=2))
    store.add(trajectory(b, turn=1))
    assert store.ready() == 0 and store.waiting() == 3
    store.add(trajectory(a, turn=2))
    unit = store.take_unit()
    assert store.path_of(unit) == (a.id, 2) and len(unit) == 2
    store.add(trajectory(b, turn=1))
    assert store.path_of(store.take_unit()) == (b.id, 1)
    assert store.waiting() == 1  # (a, 1) still open
    assert [t.keys["turn"] for t in store.drain_waiting()] == [1] and len(store) == 0
    with pytest.raises(ValueError):
        HierarchicalStore(["task"], 2)


def test_batch_readiness_by_batch_size() -> None:
    store = GroupedStore("task", 2)
    pool = PoolInstance(store, capacity=100)
    pool.put([trajectory(task(1)), trajectory(task(1)), trajectory(task(2))], reserved=0)
    assert pool.is_ready(2) and not pool.is_ready(4)


async def test_producers_wait_while_the_pool_is_full() -> None:
    pool = PoolInstance(GroupedStore("task", 2), capacity=4)
    await pool.reserve(2)
    pool.put([trajectory(task(1)), trajectory(task(1))], reserved=2)
    await pool.reserve(2)
    pool.put([trajectory(task(2)), trajectory(task(2))], reserved=2)
    producer = asyncio.ensure_future(pool.reserve(2))
    await asyncio.sleep(0.01)
    assert not producer.done()  # full: 4 of 4
    assert len(await pool.get_batch(2)) == 2  # the consumer makes room
    await asyncio.wait_for(producer, 1)
    assert pool.reserved == 2
    pool.release(2)  # an aborted rollout gives its room back
    assert pool.reserved == 0


async def test_in_flight_counts_against_capacity_when_asked() -> None:
    counting = PoolInstance(SimpleStore(), capacity=2, count_in_flight=True)
    await counting.reserve(2)
    waiting = asyncio.ensure_future(counting.reserve(1))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    counting.release(2)
    await asyncio.wait_for(waiting, 1)

    loose = PoolInstance(SimpleStore(), capacity=2)
    await loose.reserve(2)
    await asyncio.wait_for(loose.reserve(2), 1)  # in flight does not count by default


async def test_an_empty_pool_always_admits_a_unit_larger_than_capacity() -> None:
    pool = PoolInstance(SimpleStore(), capacity=2)
    await asyncio.wait_for(pool.reserve(8), 1)


async def test_get_group_prefers_the_oldest_weights_and_ends_when_closed() -> None:
    pool = PoolInstance(SimpleStore(), capacity=10)
    pool.put([trajectory(task(1), version=3), trajectory(task(2), version=1), trajectory(task(3), version=2)], 0)
    assert [(await pool.get_group())[0].version for _ in range(3)] == [1, 2, 3]
    getter = asyncio.ensure_future(pool.get_group())
    await asyncio.sleep(0.01)
    pool.close()
    assert await asyncio.wait_for(getter, 1) is None


def test_one_instance_per_model_tag() -> None:
    pool = TrajectoryPool("grouped", ["task"], 2, capacity=8)
    assert pool.instance("policy") is pool.instance("policy")
    assert pool.instance("policy") is not pool.instance("critic")
    pool.instance("policy").put([trajectory(task(1))], 0)
    assert pool.size() == 1
