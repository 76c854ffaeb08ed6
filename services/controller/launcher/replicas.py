"""A local run's rollout replicas that exit while the run goes on (healing.py says why a replica
alone is started again, and a trainer or synchronizer is not).

`ReplicaRestarts` belongs to one session's `Supervisor`: a rewind stops every
child and starts a new group, whose replicas owe nothing to the old one's.
`check()` (twice a second, from the launcher's watcher) notes a replica that
died and when it is due back, after the healer's backoff, or gives it up once
the launch is out of restarts; a dead trainer or synchronizer raises
`ServiceDied` from the supervisor. `restart_due()` starts the due ones again on
their old ports: the new process registers with the synchronizer, catches up
to the newest version before it reports SERVING, and the controller's pool
(rollouts/membership.py) gives it work again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services.controller.launcher.healing import REWIND_ON_DEATH, Healer, Restart
from services.controller.launcher.supervisor import Supervisor

log = logging.getLogger("flywheel.launch")


class ReplicaRestarts:
    def __init__(self, supervisor: Supervisor, healer: Healer | None, say: Callable[[str], None]) -> None:
        self.supervisor, self.healer, self.say = supervisor, healer, say
        #: Replicas that exited and are not started again (said once; the run goes on without them).
        self.lost: set[str] = set()
        #: Replicas that exited, and when (monotonic) each is started again.
        self.due: dict[str, float] = {}

    def check(self, pipeline: Any) -> None:
        """Notes the replicas that died since the last check (`pipeline`: the session's, for the step
        and the status page's errors; None before it exists); raises ServiceDied for any other child."""
        for name in self.supervisor.dead():
            if name in REWIND_ON_DEATH or name in self.due or name in self.lost:
                continue  # the first raises ServiceDied below
            log_path = self.supervisor.child(name).log_path
            if self.healer is None or not self.healer.may_restart():
                self.lost.add(name)
                self.say(f"warning: {name} exited (see {log_path}); the run goes on with the other replicas")
                continue
            step = pipeline.train_worker.step if pipeline is not None else 0
            delay = self.healer.backoff()
            restart = self.healer.record(Restart(
                name, self.supervisor.child(name).process.returncode, step, "restarted", redo_from_step=step + 1))
            if pipeline is not None:
                pipeline.errors.report("launcher", restart.describe(), severity="warning")
            self.say(f"healing: {restart.describe()} (restart {len(self.healer.history)} of at most "
                     f"{self.healer.policy.max_restarts}, in {delay:.0f}s; log: {log_path})")
            self.due[name] = time.monotonic() + delay
        self.supervisor.check(expendable=self.lost | set(self.due))

    async def restart_due(self) -> None:
        """Starts again, on their old ports, the replicas whose backoff is over."""
        for name, due in list(self.due.items()):
            if time.monotonic() < due:
                continue
            http = self.supervisor.run_dir / f"{name}.ready.http.json"  # the HTTP port the dead one served on
            overrides = {"http_port": json.loads(http.read_text())["http_port"]} if http.is_file() else None
            await asyncio.to_thread(self.supervisor.restart, name, overrides)
            del self.due[name]
            log.info("%s started again", name)
