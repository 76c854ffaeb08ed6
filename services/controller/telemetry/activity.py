"""Activity tracking: what is in flight, when the pipeline is quiet, and how
busy each component has been.

Every unit of work (a rollout, a train step, a weight transfer) takes a token
from `begin(module, what)` and gives it back with `end(token)` (or uses the
`track()` context manager). From the tokens the tracker knows:
- how much work is in flight per module (`in_flight`);
- quiescence: `await wait_quiescent("rollout")` returns once nothing of
  that module is in flight (sync mode pauses rollouts this way before
  moving weights);
- busy time: a module is busy while it has at least one token out; its
  busy seconds accumulate, and idle = wall time - busy (the trainer's idle
  fraction is the pipeline's bubble).

Times come from the running event loop's clock, so the same code measures
real runs and virtual-time simulations.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def now() -> float:
    return asyncio.get_running_loop().time()


@dataclass
class _Work:
    module: str
    what: str
    started: float


class ActivityTracker:
    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._work: dict[int, _Work] = {}
        self._count: dict[str, int] = defaultdict(int)
        self._busy: dict[str, float] = defaultdict(float)
        self._busy_since: dict[str, float] = {}
        self.started_at: float | None = None
        self._changed = asyncio.Event()

    def start_clock(self) -> None:
        self.started_at = now()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def begin(self, module: str, what: str = "") -> int:
        token = next(self._tokens)
        t = now()
        self._work[token] = _Work(module, what, t)
        if self._count[module] == 0:
            self._busy_since[module] = t
        self._count[module] += 1
        self._notify()
        return token

    def end(self, token: int) -> None:
        work = self._work.pop(token, None)
        if work is None:
            return  # ending twice is harmless
        self._count[work.module] -= 1
        if self._count[work.module] == 0:
            self._busy[work.module] += now() - self._busy_since.pop(work.module)
        self._notify()

    @contextmanager
    def track(self, module: str, what: str = "") -> Iterator[int]:
        token = self.begin(module, what)
        try:
            yield token
        finally:
            self.end(token)

    def in_flight(self, module: str | None = None) -> int:
        if module is None:
            return len(self._work)
        return self._count[module]

    def describe(self, module: str | None = None) -> list[str]:
        """What is in flight, for status and stuck-pipeline diagnostics."""
        return [f"{w.module}:{w.what}" for w in self._work.values() if module is None or w.module == module]

    def is_quiescent(self, module: str | None = None) -> bool:
        return self.in_flight(module) == 0

    async def wait_quiescent(self, module: str | None = None, timeout: float | None = None) -> bool:
        """True once nothing (of `module`) is in flight; False if `timeout` passed first."""

        async def wait() -> None:
            while not self.is_quiescent(module):
                await self._changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            return False
        return True

    def busy_seconds(self, module: str) -> float:
        ongoing = now() - self._busy_since[module] if module in self._busy_since else 0.0
        return self._busy[module] + ongoing

    def modules(self) -> list[str]:
        return sorted(set(self._busy) | set(self._busy_since))

    def idle_fraction(self, module: str, since: float | None = None, busy_before: float = 0.0) -> float:
        """Share of the wall time since `since` (default: start_clock) the module was idle.
        `busy_before` is the module's busy seconds at `since`, when `since` is not the start."""
        start = since if since is not None else self.started_at
        if start is None:
            return 0.0
        wall = now() - start
        if wall <= 0:
            return 0.0
        return max(0.0, 1.0 - (self.busy_seconds(module) - busy_before) / wall)
