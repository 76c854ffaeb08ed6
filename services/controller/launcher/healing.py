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

Deployed (a `services:` section: pods the kubelet restarts, not children of
this process), the launcher restarts nothing; `RemoteWatch` notices what the
kubelet did, by what the services answer, and the run catches up:

- **A rollout replica** re-registers with the synchronizer and catches up by
  itself; the pool gives it work again (nothing to do here).
- **The synchronizer** comes back empty (no store): its policy and versions
  were in memory. The trainer and the replicas re-register by their
  heartbeats and still hold their weights, so nothing is lost: the run hands
  it the policy again and the trainer's current version, and goes on.
- **The trainer** comes back with its base weights (or the checkpoint it
  loads itself): the run rewinds to the last checkpoint, as above. The
  synchronizer and the replicas still hold versions made by the lost weights
  and refuse older ones, so the rewind waits, within
  `launch.ready_timeout_seconds`, until they were restarted too (they hold
  nothing newer than the checkpoint), and says so.

Restarts are bounded (`launch.restarts.max_restarts`) and spaced by a backoff
that doubles from `backoff_seconds`: a service that dies at once again and
again ends the run instead of looping. Each one is said on the console, in
the controller log, in summary.json (`restarts`) and on the status page.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
    #: "restarted" (the service alone), "rewound" (every service, resumed from a checkpoint),
    #: deployed: "resumed" (the run resumed from a checkpoint once the service answered again) or
    #: "caught up" (the restarted service was handed the run's state; nothing redone).
    action: str
    #: The checkpoint a rewind resumed from ("" for a restart, or a rewind before any checkpoint).
    resumed_from: str = ""
    #: The first step trained again after a rewind (at_step + 1 for a restart: nothing is redone).
    redo_from_step: int = 0
    #: Deployed "resumed": the version the synchronizer and the replicas were rewound to (None: not rewound).
    rewound_to: int | None = None
    unix_time: float = field(default_factory=time.time)

    def describe(self) -> str:
        died = f"{self.service} died" + (f" (exit {self.exit_code})" if self.exit_code is not None else "") \
            + f" at step {self.at_step}"
        if self.action == "restarted":
            return f"{died}: restarted it; the run goes on"
        if self.action == "caught up":
            return f"{died}: it came back empty; handed it the run's policy and weights; nothing is redone"
        source = self.resumed_from or "the start (no checkpoint yet)"
        first, last = self.redo_from_step, self.at_step
        again = ("nothing is redone" if last < first else f"step {first} is redone" if last == first
                 else f"steps {first}-{last} are redone")
        if self.action == "resumed" and self.rewound_to is not None:
            return (f"{died}: resumed the run from {source} once it answered again, and rewound the synchronizer "
                    f"and the replicas to version {self.rewound_to}; {again}")
        if self.action == "resumed":
            return f"{died}: resumed the run from {source} once it answered again; {again}"
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


class RemoteWatch:
    """Notices, by what they answer, that deployed services died and came back.

    `look_trainer()` returns the trainer's step, or None while it has no model
    loaded (a new process); `look_synchronizer()` the synchronizer's newest
    version and its sync policy. Either raises when the service does not
    answer. `look(run_step, newest_committed)` returns what changed since the
    last look, as (service, finding) pairs; `newest_committed` is the newest
    version the run heard committed (the fleet's: weights/newest.py, the one
    holder of that fact; the watch keeps no copy of its own):

    - "down": no answer for `down_after` seconds (a slow answer on a busy
      machine is not a death);
    - "died" (trainer): it answers, but with less than the run had: not loaded,
      or a step before the run's (`run_step`, the last one the run recorded);
    - "back" (trainer): it answers with the run's step after being down: the
      same process, nothing lost;
    - "back" (synchronizer): it answers after being down, with a newest version
      older than the one the run heard committed, or with another policy than
      the run gave it: a new process, its memory gone (a pod restarts in a
      second or two: it may never have been seen down, even before the first
      look). Found once: until it holds the run's newest version again (the
      run hands it back), an answer behind it is the same finding.
    """

    def __init__(
        self,
        look_trainer: Callable[[], Awaitable[int | None]],
        look_synchronizer: Callable[[], Awaitable[tuple[int, Any]]] | None,
        *,
        down_after: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.looks = {"trainer": look_trainer, **({"synchronizer": look_synchronizer} if look_synchronizer else {})}
        self.down_after, self.clock = down_after, clock
        self.silent_since: dict[str, float] = {}
        self.down: set[str] = set()
        #: The synchronizer was found back behind the run's newest version and has not caught up yet.
        self.synchronizer_behind = False
        #: The synchronizer's policy as the run set it (None: learnt at the next look).
        self.policy: Any = None

    async def look(self, run_step: int, newest_committed: int) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for name, ask in self.looks.items():
            try:
                answer = await ask()
            except Exception:  # noqa: BLE001 - no answer is the finding
                since = self.silent_since.setdefault(name, self.clock())
                if name not in self.down and self.clock() - since >= self.down_after:
                    self.down.add(name)
                    found.append((name, "down"))
                continue
            self.silent_since.pop(name, None)
            was_down = name in self.down
            self.down.discard(name)
            if name == "trainer":
                if answer is None or answer < run_step:
                    found.append((name, "died"))
                elif was_down:
                    found.append((name, "back"))
            else:
                assert answer is not None
                newest, policy = answer
                behind = newest < newest_committed
                if was_down or (behind and not self.synchronizer_behind) or policy != (self.policy or policy):
                    found.append((name, "back"))
                    self.policy = None  # the run hands it its policy again: learnt at the next look
                else:
                    self.policy = policy
                self.synchronizer_behind = behind
        return found


def latest_checkpoint(directory: Path) -> str:
    """The newest complete global_step_N under `directory`, or ""."""
    best: tuple[int, Path] | None = None
    for path in directory.glob("global_step_*"):
        if (path / "trainer_state.json").is_file() and path.name.removeprefix("global_step_").isdigit():
            step = int(path.name.removeprefix("global_step_"))
            if best is None or step > best[0]:
                best = (step, path)
    return str(best[1]) if best else ""
