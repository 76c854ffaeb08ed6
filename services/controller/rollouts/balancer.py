"""Rollout replicas behind one interface: least-loaded routing and failover.

`EnginePool.generate` sends a request to the healthy replica with the fewest
requests in flight (ties broken round-robin, or by a sticky key so that the
turns of one agent episode reuse a replica's prefix cache). If the replica is
unreachable (`Unavailable`, `DeadlineExceeded`, a dropped connection) it is
marked down and the request goes to the next healthy one; when none is left
the call raises `Unavailable` and the worker retries the task later. The
liveness monitor marks replicas up again once their health check passes.
An external agent's session stays on the replica it was opened on;
`occupied` counts the episode in that replica's load meanwhile.

Each replica's weight version and quarantine are the synchronizer's, and
only the synchronizer's: `observe(component)` is their one writer (every
event about a replica: services.controller.rollouts.membership). A quarantined
replica (its last weight update failed; weights/fleet.py) gets no traffic,
rollouts and agent sessions alike, until an update of it verifies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from flywheel.errors import DeadlineExceeded, Unavailable
from services.controller.domain import Generation, PromptInput, SamplingSpec
from services.controller.protocols import RolloutEngine

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors after which a request is retried on another replica.
FAILOVER_ERRORS = (Unavailable, DeadlineExceeded, ConnectionError, TimeoutError)


@dataclass
class Replica:
    engine: RolloutEngine
    healthy: bool = True
    in_flight: int = 0
    #: The version it serves, as the synchronizer reports it.
    version: int = 0
    failures: int = 0
    last_error: str = ""
    #: Its last weight update failed (the synchronizer's flag): no traffic until one verifies.
    quarantined: bool = False
    quarantine_reason: str = ""

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def serves(self) -> bool:
        """Takes work: answering its health checks, and not quarantined."""
        return self.healthy and not self.quarantined


class EnginePool:
    def __init__(self, engines: Sequence[RolloutEngine], *, dynamic: bool = False) -> None:
        """`dynamic`: replicas are added as they register (services.controller.rollouts.membership); may start empty."""
        if not engines and not dynamic:
            raise ValueError("at least one rollout engine is needed")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout engine names must be unique, got {names}")
        self.replicas = [Replica(e) for e in engines]
        self._by_name = {r.name: r for r in self.replicas}
        self._turn = itertools.count()
        #: Called with (replica name, healthy) when a replica changes state.
        self.on_health_change: Callable[[str, bool], None] | None = None

    def __len__(self) -> int:
        return len(self.replicas)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def add(self, engine: RolloutEngine, *, healthy: bool = False) -> Replica:
        """A replica that joined the run; it takes work once marked healthy."""
        if engine.name in self._by_name:
            raise ValueError(f"rollout replica {engine.name!r} is in the pool already")
        replica = Replica(engine, healthy=healthy)
        self.replicas.append(replica)
        self._by_name[engine.name] = replica
        log.info("rollout replica %s joined the pool", engine.name)
        return replica

    def replica(self, name: str) -> Replica:
        return self._by_name[name]

    def healthy(self) -> list[Replica]:
        """The replicas that take work (healthy and not quarantined)."""
        return [r for r in self.replicas if r.serves]

    async def until_one_serves(self, limit_seconds: float | None = None, poll_seconds: float = 0.2) -> bool:
        """Waits until some replica is healthy; False when none is within `limit_seconds` (None: no limit).

        Rollouts wait here instead of failing while every replica is down (the only one is
        restarting, say): a failed call counts toward a task's retries, and a task out of retries
        is given up, which would lose it from the epoch."""
        loop = asyncio.get_running_loop()  # its clock: simulated runs advance it without waiting
        deadline = None if limit_seconds is None else loop.time() + limit_seconds
        while not self.healthy():
            if deadline is not None and loop.time() > deadline:
                return False
            await asyncio.sleep(poll_seconds)
        return True

    def min_version(self) -> int:
        """Oldest weight version a replica that takes work serves (0 with none)."""
        live = self.healthy() or self.replicas
        return min((r.version for r in live), default=0)

    def observe(self, name: str, version: int, quarantined: bool, reason: str = "") -> None:
        """What the synchronizer says of the replica: its version (which may go down: a restart
        registers on its base weights) and whether it is quarantined."""
        replica = self._by_name[name]
        replica.version = version
        if quarantined != replica.quarantined:
            if quarantined:
                log.warning("rollout replica %s is quarantined (no traffic): %s", name, reason)
            else:
                log.info("rollout replica %s rejoins: its weight update verified", name)
            replica.quarantined = quarantined
            if self.on_health_change is not None:
                self.on_health_change(name, replica.serves)
        replica.quarantine_reason = reason if quarantined else ""

    def mark(self, name: str, healthy: bool, error: str = "") -> None:
        replica = self._by_name[name]
        if replica.healthy != healthy:
            log.warning("rollout replica %s is %s %s", name, "up" if healthy else "down", error)
            replica.healthy = healthy
            if self.on_health_change is not None:
                self.on_health_change(name, healthy)
        if error:
            replica.last_error = error

    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def _pick(self, exclude: set[str], sticky: str | None) -> Replica | None:
        candidates = [r for r in self.replicas if r.serves and r.name not in exclude]
        if not candidates:
            return None
        if sticky is not None:
            return candidates[zlib.crc32(sticky.encode()) % len(candidates)]
        turn = next(self._turn)
        # Least loaded first; the rotating offset spreads ties evenly.
        return min(candidates, key=lambda r: (r.in_flight, (self.replicas.index(r) - turn) % len(self.replicas)))

    async def call(self, fn: Callable[[RolloutEngine], Awaitable[T]], *, sticky: str | None = None) -> tuple[T, Replica]:
        """Runs fn on a healthy replica, failing over to the others."""
        tried: set[str] = set()
        last: BaseException | None = None
        while (replica := self._pick(tried, sticky)) is not None:
            tried.add(replica.name)
            replica.in_flight += 1
            try:
                return await fn(replica.engine), replica
            except FAILOVER_ERRORS as exc:
                replica.failures += 1
                self.mark(replica.name, False, f"{type(exc).__name__}: {exc}")
                last = exc
            finally:
                replica.in_flight -= 1
        detail = f" (last error: {last})" if last else ""
        raise Unavailable(f"no healthy rollout replica of {len(self.replicas)}{detail}")

    @contextmanager
    def occupied(self, replica: Replica) -> Iterator[None]:
        """Counts work that runs on `replica` outside `call` (an agent's session) in its load."""
        replica.in_flight += 1
        try:
            yield
        finally:
            replica.in_flight -= 1

    async def generate(
        self, prompts: Sequence[PromptInput], sampling: SamplingSpec, *, sticky: str | None = None
    ) -> list[list[Generation]]:
        results, replica = await self.call(lambda e: e.generate(prompts, sampling), sticky=sticky)
        for per_prompt in results:
            for g in per_prompt:
                g.engine = replica.name
        return results

    async def tokenize(
        self, *, text: str | None = None, messages: list[dict] | None = None, add_generation_prompt: bool = True,
        sticky: str | None = None,
    ) -> list[int]:
        ids, _ = await self.call(
            lambda e: e.tokenize(text=text, messages=messages, add_generation_prompt=add_generation_prompt),
            sticky=sticky,
        )
        return ids
