"""Simulated time: the distributions simulated work takes, and an asyncio loop on a virtual clock.

`VirtualTimeLoop` is an asyncio event loop whose clock jumps straight to the
next timer when nothing is runnable, so a simulated run of minutes takes
milliseconds and is deterministic for a given seed; a deadlock (nothing
runnable, no timer) raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import math
import random
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
Draw = Callable[[], float]


# -- time distributions --------------------------------------------------------
def lognormal(mean: float, sigma: float, rng: random.Random) -> Draw:
    """Long-tailed times with the given mean (sigma is the log-space std)."""
    mu = math.log(mean) - sigma * sigma / 2
    return lambda: rng.lognormvariate(mu, sigma)


def normal(mean: float, cv: float, rng: random.Random) -> Draw:
    """Near-constant times: mean with coefficient of variation cv, at least 5% of the mean."""
    return lambda: max(0.05 * mean, rng.gauss(mean, cv * mean))


def constant(value: float) -> Draw:
    return lambda: value


# -- a virtual clock -------------------------------------------------------------
class SimulationDeadlock(RuntimeError):
    """Nothing could ever run again: every task waits on something no one will set."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if ready or self.loop is None:
            return ready
        if timeout is None:
            # Only a thread (to_thread, an executor) can still wake us: give it a real moment.
            ready = super().select(1.0)
            if ready:
                return ready
            raise SimulationDeadlock("simulation deadlocked: no runnable task and no timer")
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


async def _settle(tasks: set[asyncio.Task]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on a fresh VirtualTimeLoop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(_settle(leftover))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
