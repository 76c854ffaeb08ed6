"""What the launcher does when one of its services dies, and the record of it.

Two remedies, chosen by what the dead service held:

- **A rollout replica** holds nothing the run needs: it is started again on its
  old ports (the controller and the synchronizer hold its address), registers
  with the synchronizer, pulls the newest version before it reports SERVING,
  and takes work again. Requests it had in flight fail over or are retried.
- **The trainer or the synchronizer** held state that died with it: the
  trainer's weights and optimizer since the last checkpoint, the
  synchronizer's weight versions (their bytes live in its memory). Going on
  would train on samples made by weights that no longer exist anywhere. So
  the run *rewinds*: every service is stopped and started again, and the run
  resumes from the last checkpoint, exactly as the same command typed again
  would. Steps after that checkpoint are redone with fresh samples, and the
  ledger (trained_tasks.jsonl) keeps the later session's line for each step,
  so every task is trained once in the final model's lineage.

Restarts are bounded (`launch.restarts.max_restarts`) and spaced by a backoff
that doubles from `backoff_seconds`: a service that dies at once again and
again ends the run instead of looping. Each one is said on the console, in
the controller log, in summary.json (`restarts`) and on the status page.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import Field

from flywheel.runtime.config import StrictModel

#: Services whose death rewinds the run to its last checkpoint; any other is restarted alone.
REWIND_ON_DEATH = ("trainer", "synchronizer")


class RestartPolicy(StrictModel):
    max_restarts: int = Field(
        5, ge=0, description="services restarted per run, replicas and rewinds together; 0: a dead trainer or "
        "synchronizer ends the run (exit 1) and a dead replica stays dead"
    )
    backoff_seconds: float = Field(2.0, ge=0, description="wait before the first restart, doubled for each later one")
    max_backoff_seconds: float = Field(60.0, ge=0, description="longest wait before a restart, in seconds")


@dataclass
class Restart:
    """One service death and what was done about it."""

    service: str
    exit_code: int | None
    #: The trainer's step when the death was noticed.
    at_step: int
    #: "restarted" (the service alone) or "rewound" (every service, resumed from a checkpoint).
    action: str
    #: The checkpoint a rewind resumed from ("" for a restart, or a rewind before any checkpoint).
    resumed_from: str = ""
    #: The first step trained again after a rewind (at_step + 1 for a restart: nothing is redone).
    redo_from_step: int = 0
    unix_time: float = field(default_factory=time.time)

    def describe(self) -> str:
        died = f"{self.service} died (exit {self.exit_code}) at step {self.at_step}"
        if self.action == "restarted":
            return f"{died}: restarted it; the run goes on"
        source = self.resumed_from or "the start (no checkpoint yet)"
        first, last = self.redo_from_step, self.at_step
        again = ("nothing is redone" if last < first else f"step {first} is redone" if last == first
                 else f"steps {first}-{last} are redone")
        return f"{died}: restarted every service and resumed from {source}; {again}"


class Healer:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.history: list[Restart] = []

    def may_restart(self) -> bool:
        return len(self.history) < self.policy.max_restarts

    def backoff(self) -> float:
        """Seconds to wait before the next restart."""
        return min(self.policy.max_backoff_seconds, self.policy.backoff_seconds * 2 ** len(self.history))

    def record(self, restart: Restart) -> Restart:
        self.history.append(restart)
        return restart

    def summary(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.history]
