"""Exponential backoff for loops that retry an unreachable peer forever."""

from __future__ import annotations

import asyncio


class Backoff:
    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.delay = initial

    async def wait(self) -> None:
        """Sleeps the current delay, then doubles it (up to the maximum)."""
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.maximum)

    def reset(self) -> None:
        """The peer answered: the next failure starts over from the first delay."""
        self.delay = self.initial
