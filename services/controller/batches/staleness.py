"""Staleness accounting: admission of new rollouts against a version bound.

Batches are assembled and trained in order, so the sample at position p of
the run (0-based, counting only samples that end up in a batch) is trained
at trainer version `base + p // B`. A rollout started now on weights of
version r (the oldest a healthy replica may serve) and landing at position p
has staleness `base + p // B - r`.

`StalenessGate.admit(n)` lets n new samples start only if even the last of
them, placed after everything already accepted *or still pending* (in
flight, pooled, being processed), stays within the limit:

    base + (accepted + pending + n - 1) // B - rollout_version <= limit

Counting pending samples is what stops a burst of admissions from
overshooting the bound. Dropped samples (failed, filtered by dynamic
sampling) leave `pending` and free their positions.

Each admitted group is *planned* into the batch of its position
(`plan()`, whose version + 1 is the run step the rollout is tagged with);
a rollout replica generates it on weights at least `planned - limit`
(batch-async's STALENESS wait; sync mode's due version; standalone, the
replicas are already there at admission). So the planned version is the
latest batch the group may join without going over the bound (later by
`threshold - limit` when the gate's limit, staleness.lookahead, is below the
bound): its *deadline*, known before it finishes; once it finishes, its real
deadline is `oldest start version + bound`, never earlier. The gate keeps the deadlines
of the groups still in flight (`in_flight()`), which is what lets the
processor pace assembly (staleness.policy: pace, processor.py): it never
closes a batch that would leave a group unable to make its deadline.

Samples that finish out of order can otherwise land in a later batch than
the gate planned for: with staleness.policy drop the processor re-checks
each group against its real batch version (`is_stale`) and drops it (its
task retried), with correct it is kept for the trainer's IS correction.

limit 0 is on-policy (sync mode); None disables the bound (fully-async).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Planned:
    """An admitted group in flight: the batch version it was planned into (its
    deadline while it runs) and its sample count. Compared by identity."""

    version: int
    samples: int

    @property
    def run_step(self) -> int:
        """The run step (train batch, from 1) a replica counts this rollout under."""
        return self.version + 1


class StalenessGate:
    def __init__(self, batch_size: int, limit: int | None, base_version: int = 0, rollout_version: int = 0) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.batch_size, self.limit = batch_size, limit
        self.base_version = base_version
        self.rollout_version = rollout_version
        #: Samples placed into train batches.
        self.accepted = 0
        #: Samples admitted and neither accepted nor dropped yet.
        self.pending = 0
        self.closed = False
        #: Admitted groups not yet finished (or given up), with their planned versions.
        self._in_flight: set[Planned] = set()
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    @property
    def next_batch_version(self) -> int:
        """Trainer version of the batch being assembled now."""
        return self.base_version + self.accepted // self.batch_size

    def version_at(self, position: int) -> int:
        return self.base_version + position // self.batch_size

    def fits(self, n: int) -> bool:
        if self.limit is None:
            return True
        last = self.accepted + self.pending + n - 1
        return self.version_at(last) - self.rollout_version <= self.limit

    async def admit(self, n: int) -> bool:
        """Waits until n samples may start; False if the gate was closed meanwhile."""
        while not self.fits(n):
            if self.closed:
                return False
            await self._changed.wait()
        if self.closed:
            return False
        self.pending += n
        return True

    def run_step_of_admitted(self, n: int) -> int:
        """The run step (train batch, from 1, counting from the run's first
        version) that the last `n` admitted samples are planned into."""
        return self.version_at(self.accepted + self.pending - 1) + 1

    def plan(self, n: int) -> Planned:
        """Records the last `n` admitted samples as one group in flight, planned
        into the batch their positions fall in (call right after `admit(n)`)."""
        planned = Planned(self.version_at(self.accepted + self.pending - 1), n)
        self._in_flight.add(planned)
        return planned

    def landed(self, planned: Planned) -> None:
        """The group finished (pooled) or was given up: it is no longer in flight.
        Call before the `drop()` or pool put that follows, so waiters see both."""
        self._in_flight.discard(planned)

    def in_flight(self) -> list[Planned]:
        return list(self._in_flight)

    def changed(self) -> Coroutine[Any, Any, Any]:
        """Awaitable that completes at the next change (accept, drop, version, close)."""
        return self._changed.wait()

    def accept(self, n: int) -> None:
        self.pending -= n
        self.accepted += n
        self._notify()

    def drop(self, n: int) -> None:
        self.pending -= n
        self._notify()

    def set_rollout_version(self, version: int) -> None:
        if version != self.rollout_version:
            self.rollout_version = version
            self._notify()

    def batch_not_trained(self) -> None:
        """A batch was given up without a step: later batches train one version earlier."""
        self.base_version -= 1
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()


def is_stale(sample_version: int, batch_version: int, limit: int | None) -> bool:
    return limit is not None and batch_version - sample_version > limit
