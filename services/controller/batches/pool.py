"""The trajectory pool: scored trajectories waiting for the algorithm.

One `PoolInstance` per model tag, each holding one store:

- `SimpleStore`: FIFO of single trajectories.
- `GroupedStore`: groups by one key (e.g. the task id); a group is released
  when it reaches `group_size` (GRPO needs whole groups).
- `HierarchicalStore`: nested keys (e.g. task, then turn); leaf groups are
  released at `group_size` (`path_of(unit)` gives their key path).

Readiness is by batch size (`is_ready(n)` / `get_batch(n)`) or one released
unit at a time (`get_group()`, what the algorithm processor uses).

Capacity is bounded (`buffer_size_limit`, default twice the trainer batch):
a producer `reserve()`s room before it starts generating and waits while the
pool is full, so producers stop instead of generating ever-staler data. By
default only pooled samples count against the limit (rollouts already in
flight may land on top of it, at most max_in_flight groups): the pool then
keeps a ready batch while new rollouts run, which is what keeps the trainer
busy. With `count_in_flight` the limit also covers rollouts in flight
(fresher data, less overlap). A reservation is turned into trajectories by
`put()` or given back by `release()`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

from services.controller.domain import Trajectory


class TrajectoryStore(ABC):
    """Holds trajectories until they form releasable units."""

    def __init__(self) -> None:
        self._ready: deque[list[Trajectory]] = deque()
        self._ready_samples = 0

    @abstractmethod
    def add(self, trajectory: Trajectory) -> None: ...

    @abstractmethod
    def waiting(self) -> int:
        """Samples held in units that are not complete yet."""

    def _release(self, unit: list[Trajectory]) -> None:
        self._ready.append(unit)
        self._ready_samples += len(unit)

    def ready(self) -> int:
        """Samples in released units."""
        return self._ready_samples

    def __len__(self) -> int:
        return self._ready_samples + self.waiting()

    def take_unit(self, oldest_first: bool = False) -> list[Trajectory] | None:
        """The first released unit, or with oldest_first the one generated on the
        oldest weights (it has the least staleness budget left)."""
        if not self._ready:
            return None
        if oldest_first:
            index = min(range(len(self._ready)), key=lambda i: min(t.version for t in self._ready[i]))
            unit = self._ready[index]
            del self._ready[index]
        else:
            unit = self._ready.popleft()
        self._ready_samples -= len(unit)
        return unit

    def take(self, max_samples: int) -> list[list[Trajectory]]:
        """Whole released units, oldest first, totalling at most max_samples."""
        units, total = [], 0
        while self._ready and total + len(self._ready[0]) <= max_samples:
            unit = self.take_unit()
            assert unit is not None
            units.append(unit)
            total += len(unit)
        return units

    @abstractmethod
    def drain_waiting(self) -> list[Trajectory]:
        """Removes and returns the trajectories of incomplete units."""


class SimpleStore(TrajectoryStore):
    def add(self, trajectory: Trajectory) -> None:
        self._release([trajectory])

    def waiting(self) -> int:
        return 0

    def drain_waiting(self) -> list[Trajectory]:
        return []


class GroupedStore(TrajectoryStore):
    def __init__(self, key: str, group_size: int) -> None:
        super().__init__()
        self.key, self.group_size = key, group_size
        self._groups: dict[Any, list[Trajectory]] = {}

    def add(self, trajectory: Trajectory) -> None:
        group = self._groups.setdefault(trajectory.key(self.key), [])
        group.append(trajectory)
        if len(group) >= self.group_size:
            self._release(self._groups.pop(trajectory.key(self.key)))

    def waiting(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def drain_waiting(self) -> list[Trajectory]:
        out = [t for g in self._groups.values() for t in g]
        self._groups.clear()
        return out


class HierarchicalStore(TrajectoryStore):
    def __init__(self, keys: Sequence[str], group_size: int) -> None:
        super().__init__()
        if len(keys) < 2:
            raise ValueError("a hierarchical store needs at least two keys")
        self.keys, self.group_size = list(keys), group_size
        self._tree: dict[Any, Any] = {}

    def add(self, trajectory: Trajectory) -> None:
        path = tuple(trajectory.key(k) for k in self.keys)
        node = self._tree
        for value in path[:-1]:
            node = node.setdefault(value, {})
        leaf = node.setdefault(path[-1], [])
        leaf.append(trajectory)
        if len(leaf) >= self.group_size:
            del node[path[-1]]
            self._prune(path[:-1])
            self._release(leaf)

    def path_of(self, unit: Sequence[Trajectory]) -> tuple[Any, ...]:
        """The key path a released unit was grouped under."""
        return tuple(unit[0].key(k) for k in self.keys)

    def _prune(self, path: tuple[Any, ...]) -> None:
        # Drop emptied intermediate levels so the tree does not grow forever.
        for depth in range(len(path), 0, -1):
            parent = self._tree
            for value in path[: depth - 1]:
                parent = parent[value]
            if parent[path[depth - 1]]:
                return
            del parent[path[depth - 1]]

    def _leaves(self, node: dict[Any, Any]) -> list[list[Trajectory]]:
        out = []
        for child in node.values():
            out.extend(self._leaves(child) if isinstance(child, dict) else [child])
        return out

    def waiting(self) -> int:
        return sum(len(leaf) for leaf in self._leaves(self._tree))

    def drain_waiting(self) -> list[Trajectory]:
        out = [t for leaf in self._leaves(self._tree) for t in leaf]
        self._tree.clear()
        return out


def make_store(kind: str, keys: Sequence[str], group_size: int) -> TrajectoryStore:
    if kind == "simple":
        return SimpleStore()
    if kind == "grouped":
        return GroupedStore(keys[0] if keys else "task", group_size)
    if kind == "hierarchical":
        return HierarchicalStore(keys, group_size)
    raise ValueError(f"unknown store {kind!r}: simple, grouped or hierarchical")


class PoolInstance:
    """One model tag's store with bounded capacity and async waiting."""

    def __init__(self, store: TrajectoryStore, capacity: int, count_in_flight: bool = False) -> None:
        self.store, self.capacity, self.count_in_flight = store, capacity, count_in_flight
        #: Samples reserved by producers and not yet put or released (in flight).
        self.reserved = 0
        self.closed = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def size(self) -> int:
        """Samples that count against capacity."""
        return len(self.store) + (self.reserved if self.count_in_flight else 0)

    def fits(self, n: int) -> bool:
        # An empty pool always admits, so a unit larger than the limit cannot deadlock.
        return self.size() + n <= self.capacity or self.size() == 0

    async def reserve(self, n: int) -> None:
        while not self.fits(n):
            await self._changed.wait()
        self.reserved += n

    def release(self, n: int) -> None:
        self.reserved -= n
        self._notify()

    def put(self, trajectories: Sequence[Trajectory], reserved: int) -> None:
        self.reserved -= reserved
        for t in trajectories:
            self.store.add(t)
        self._notify()

    def is_ready(self, batch_size: int) -> bool:
        return self.store.ready() >= batch_size

    async def get_group(self, oldest_first: bool = True) -> list[Trajectory] | None:
        """A released unit (by default the one on the oldest weights: it is the
        likeliest to go stale); None once the pool is closed and has none."""
        while True:
            unit = self.store.take_unit(oldest_first)
            if unit is not None:
                self._notify()
                return unit
            if self.closed:
                return None
            await self._changed.wait()

    async def get_batch(self, batch_size: int) -> list[Trajectory] | None:
        """batch_size samples in whole units, once ready; None if closed first."""
        while not self.is_ready(batch_size):
            if self.closed:
                return None
            await self._changed.wait()
        units = self.store.take(batch_size)
        self._notify()
        return [t for unit in units for t in unit]

    def close(self) -> None:
        self.closed = True
        self._notify()


class TrajectoryPool:
    """Routes trajectories to the instance of their model tag."""

    def __init__(
        self, store_kind: str, keys: Sequence[str], group_size: int, capacity: int, count_in_flight: bool = False
    ) -> None:
        self._spec = (store_kind, list(keys), group_size)
        self.capacity, self.count_in_flight = capacity, count_in_flight
        self.instances: dict[str, PoolInstance] = {}

    def instance(self, tag: str = "default") -> PoolInstance:
        if tag not in self.instances:
            self.instances[tag] = PoolInstance(make_store(*self._spec), self.capacity, self.count_in_flight)
        return self.instances[tag]

    def size(self) -> int:
        return sum(len(i.store) for i in self.instances.values())

    def close(self) -> None:
        for instance in self.instances.values():
            instance.close()
