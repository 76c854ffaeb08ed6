"""A deployment's services as the launcher sees them: a run file that names its
services (`services:`), none started here. A Kubernetes Job, or a user
pointing a run at services already up.

What this adds to a run on this machine (`local_run.LocalRun`):

- before a session: wait until every named service reports SERVING and the
  trainer is registered with the synchronizer (`wait_until_serving`);
- while it runs, with restarts allowed: ask the trainer and the
  synchronizer what they hold (`healing.RemoteWatch`, `look`). A
  synchronizer the kubelet restarted is handed the run's policy and the
  trainer's weights (nothing redone); a trainer that came back without the
  run's state raises `ServiceDied`, and the run resumes from its last
  checkpoint;
- when a session resumes from a checkpoint: nothing may hold weights newer
  than it, made by weights that died with an earlier trainer. The
  synchronizer and the replicas are rewound to its version (`rewind`; with
  no checkpoint yet, to version 0: the run starts over from the base model,
  which the replicas reload); where they cannot be (a synchronizer without
  Rewind) an operator restarts them, and `until_nothing_newer` waits and says
  which.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from flywheel.launcher.processes import ServiceDied
from services.controller.launcher.healing import Healer, RemoteWatch, Restart
from services.controller.run_config import ServicesConfig

log = logging.getLogger("flywheel.launch")


async def _nothing() -> None:
    return None


@dataclass
class Deployment:
    services: ServicesConfig
    #: launch.ready_timeout_seconds: how long services may take to answer (or to be restarted).
    ready_timeout_seconds: float
    #: The launcher's console.
    say: Callable[[str], None]
    healer: Healer | None = None
    #: What the services answer, looked at while a session runs (None: not watched).
    remote: RemoteWatch | None = None

    def _token(self) -> str | None:
        from flywheel.runtime.auth import resolve_token

        return resolve_token(None, self.services.auth_token_file)

    def _synchronizer(self, timeout: float) -> Any:
        from flywheel.synchronizer.client import SynchronizerClient

        assert self.services.synchronizer is not None
        return SynchronizerClient(self.services.synchronizer.address, self._token(), timeout=timeout)

    # -- before a session ------------------------------------------------------

    def wait_until_serving(self) -> None:
        """Deployed services come up in any order: a Kubernetes Job starts beside the pods it
        drives, which may still be loading their models. Waits, up to
        launch.ready_timeout_seconds, until the synchronizer, the trainer and every listed
        rollout report SERVING (unreachable or unresolvable names are retried) and, with a
        synchronizer, until the trainer is registered there: a trainer that cannot reach the
        synchronizer publishes nothing, and the run would wait for its first version forever.
        Registered rollouts are waited for by the run itself (services.wait_for_rollout_seconds)."""
        from flywheel.runtime.health import check_health

        services = self.services
        pending = {
            name: endpoint.address
            for name, endpoint in [("synchronizer", services.synchronizer), ("trainer", services.trainer),
                                   *((f"rollout {r.address}", r) for r in services.rollout)]
            if endpoint is not None
        }
        deadline = time.monotonic() + self.ready_timeout_seconds
        status: dict[str, str] = {}
        said = False
        while pending:
            for name, address in list(pending.items()):
                status[name] = asyncio.run(check_health(address, timeout=2.0))
                if status[name] == "SERVING":
                    del pending[name]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"services not ready after {self.ready_timeout_seconds:.0f}s (launch.ready_timeout_seconds): "
                    + ", ".join(f"{n} at {a}: {status[n]}" for n, a in pending.items()))
            if not said:
                self.say("waiting for " + ", ".join(f"{n} ({a})" for n, a in pending.items()) + " to report SERVING")
                said = True
            time.sleep(0.25)  # a health check is cheap; a second's poll was half a second late on average
        if services.synchronizer is None:
            return
        while (registration := asyncio.run(self.trainer_registration())) != "registered":
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer {services.trainer_id!r} never registered with the synchronizer at "
                    f"{services.synchronizer.address} within {self.ready_timeout_seconds:.0f}s "
                    f"({registration}): its sync.synchronizer_address must reach this synchronizer and its "
                    "sync.trainer_id be services.trainer_id (the trainer's log says what failed)")
            time.sleep(0.25)

    async def trainer_registration(self) -> str:
        """"registered" when the synchronizer lists the run's trainer, else what it lists instead."""
        client = self._synchronizer(timeout=5.0)
        try:
            components = (await client.status()).components
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            return f"status failed: {exc}"
        finally:
            await client.close()
        ids = [c.id for c in components]
        return "registered" if self.services.trainer_id in ids else f"the synchronizer lists {ids}"

    # -- nothing newer than the checkpoint -------------------------------------

    async def until_nothing_newer(self, step: int, *, rewound: bool = False) -> None:
        """Resuming at `step`: the synchronizer and the rollout replicas may still hold
        versions made by weights that died with a trainer after `step` (a replica would serve the
        lost weights). Waits, up to launch.ready_timeout_seconds, until none holds a version newer
        than `step`: `rewound` (the synchronizer was rewound to `step`), until the replicas loaded
        it; else until they were restarted (a synchronizer that cannot rewind; the synchronizer
        without a store comes back empty, a replica with its base weights), saying once which."""
        if self.services.synchronizer is None:
            return
        deadline = time.monotonic() + self.ready_timeout_seconds
        said = rewound
        while (held := await self.newer_than(step)) != []:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{', '.join(held or ['the synchronizer (not answering)'])} still hold weights newer than step "
                    f"{step} after {self.ready_timeout_seconds:.0f}s (launch.ready_timeout_seconds)"
                    + (" although the synchronizer was rewound to it" if rewound else "")
                    + ": restart them, then run the same command again")
            if held and not said:
                self.say(f"healing: {', '.join(held)} hold weights newer than step {step}, made by weights that died "
                         "with the trainer: restart them (Kubernetes: kubectl -n flywheel rollout restart "
                         "statefulset/flywheel-synchronizer deployment/flywheel-rollout); waiting up to "
                         f"{self.ready_timeout_seconds:.0f}s")
                said = True
            await asyncio.sleep(1.0)

    async def newer_than(self, version: int) -> list[str] | None:
        """The services that hold a weight version newer than `version` (None: the synchronizer does not answer)."""
        from flywheel.synchronizer.types import Role, State

        client = self._synchronizer(timeout=5.0)
        try:
            status = await client.status()
        except Exception:  # noqa: BLE001 - asked again until the deadline
            return None
        finally:
            await client.close()
        held = [f"the synchronizer (version {status.latest_version})"] if status.latest_version > version else []
        return held + [f"rollout {c.id} (version {c.weight_version})" for c in status.components
                       if c.role == Role.ROLLOUT and c.state != State.STOPPED and c.weight_version > version]

    def rewind_on_resume(self, pipeline: Any) -> None:
        """Once the session resumed from a checkpoint (the trainer loaded it), and before
        anything is generated, no service may hold newer weights: `rewind`, as the
        pipeline's after_resume hook. After a trainer death in this command, and in a
        new command (a Job's next pod) after one."""
        pipeline.hooks.after_resume.append(self.rewind)

    async def rewind(self, pipeline: Any) -> None:
        """The trainer is at the checkpoint's version N. A synchronizer or replica holding a newer
        one holds weights that died with an earlier trainer: the synchronizer is rewound to N
        (its Rewind drops the newer versions and sends the replicas back), the trainer publishes
        N again for the replicas to load, and this waits until every replica did. N = 0 (the
        trainer died before its first checkpoint) starts the run over: every version is dropped
        and the replicas reload their base weights. A synchronizer without Rewind (older)
        leaves it to an operator to restart them (`until_nothing_newer` says which)."""
        from flywheel.errors import FlywheelError

        version = pipeline.train_worker.version
        if self.services.synchronizer is None or not await self.newer_than(version):
            await self.until_nothing_newer(version)
            return
        client = self._synchronizer(timeout=10.0)
        try:
            why = (f"the trainer resumed from its checkpoint of step {version}" if version
                   else "the trainer restarted before its first checkpoint: the run starts over from the base model")
            rewound = await client.rewind(version, why)
        except FlywheelError as exc:
            if getattr(exc, "code", "") != "UNIMPLEMENTED":
                raise
            log.warning("the synchronizer cannot rewind (%s); waiting for an operator to restart it", exc)
            await self.until_nothing_newer(version)
            return
        finally:
            await client.close()
        dropped = ", ".join(map(str, rewound.dropped)) or "none"
        replicas = ", ".join(rewound.rewinding) or "none"
        message = (f"healing: rewound the synchronizer and the replicas to version {version} (lineage "
                   f"{rewound.epoch}; versions dropped: {dropped}; replicas going back: {replicas})")
        log.warning(message)
        self.say(message)
        restart = self.healer.history[-1] if self.healer and self.healer.history else None
        if restart is not None and restart.action == "resumed" and restart.rewound_to is None:
            restart.rewound_to = version
        # The synchronizer has the trainer publish the rewound version again where the replicas cannot
        # pull it (MEMORY bytes no longer held; NCCL, which keeps none); they load it by themselves.
        await self.until_nothing_newer(version, rewound=True)

    # -- while a session runs --------------------------------------------------

    def watch(self) -> Callable[[], Awaitable[None]]:
        """With restarts allowed: `remote` looks at the trainer and the synchronizer for this
        session (healing.RemoteWatch). Returns what closes its clients."""
        from flywheel.trainer.client import TrainerClient

        self.remote = None
        if self.healer is None or self.healer.policy.max_restarts == 0:
            return _nothing
        trainer = TrainerClient(self.services.trainer.address, token=self._token(), timeout=5.0)
        synchronizer = self._synchronizer(timeout=5.0) if self.services.synchronizer is not None else None

        async def look_trainer() -> int | None:
            info = await trainer.get_info(timeout=5.0)
            return info.step if info.ready else None

        async def look_synchronizer() -> tuple[int, Any]:
            assert synchronizer is not None
            status = await synchronizer.status()
            return status.latest_version, status.policy

        self.remote = RemoteWatch(look_trainer, look_synchronizer if synchronizer is not None else None)

        async def close() -> None:
            self.remote = None
            await trainer.close()
            if synchronizer is not None:
                await synchronizer.close()

        return close

    async def look(self, pipeline: Any, *, even_before_start: bool = False) -> None:
        """What the services answer now (healing.RemoteWatch), and what is done about it.
        A synchronizer the kubelet restarted is handed the run's policy and the trainer's weights
        while the run goes on; a trainer that lost the run's state raises ServiceDied (a rewind)."""
        if self.remote is None or not (even_before_start or pipeline.state.started):
            return  # until the session's start is done (resumed, policy given): the services move under it
        step = pipeline.train_worker.step
        for service, finding in await self.remote.look(step, pipeline.fleet.newest.value):
            if finding == "down":
                message = f"{service} stopped answering at step {step}; waiting for it"
                pipeline.errors.report("launcher", message, severity="warning")
                self.say(f"warning: {message}")
            elif service == "trainer" and finding == "back":
                self.say(f"the trainer answers again at step {step}, its state intact")
            elif service == "trainer":
                raise ServiceDied(f"the trainer came back without the run's state (the run was at step {step})",
                                  "trainer")
            elif finding == "back":
                await self.catch_up_synchronizer(pipeline)

    async def catch_up_synchronizer(self, pipeline: Any) -> None:
        """A restarted synchronizer knows no policy and no version; the trainer and the replicas
        re-register by their heartbeats with their weights. Handing it the run's policy and the
        trainer's current version is all it lacks: nothing is redone."""
        assert self.healer is not None
        step = pipeline.train_worker.step
        if not self.healer.may_restart():
            raise ServiceDied(f"the synchronizer came back empty at step {step}, and no restart is left "
                              f"(launch.restarts.max_restarts {self.healer.policy.max_restarts})", "synchronizer")
        restart = self.healer.record(Restart("synchronizer", None, step, "caught up", redo_from_step=step + 1))
        pipeline.errors.report("launcher", restart.describe(), severity="warning")
        log.warning("healing: %s", restart.describe())
        self.say(f"healing: {restart.describe()} (restart {len(self.healer.history)} of at most "
                 f"{self.healer.policy.max_restarts})")
        try:
            await pipeline.fleet.configure()
            await pipeline.fleet.need(pipeline.train_worker.version, "the synchronizer restarted without it")
        except Exception as exc:  # noqa: BLE001 - the trainer publishes its next version by itself
            log.warning("handing the restarted synchronizer the run's state: %s", exc)

    async def diagnose(self, pipeline: Any) -> None:
        """The run failed: if the trainer died (no answer for RemoteWatch.down_after, or back
        without the run's state), that is the cause, and ServiceDied rewinds the run."""
        if self.remote is None:
            return
        deadline = time.monotonic() + self.remote.down_after + 5.0
        while time.monotonic() < deadline and "trainer" not in self.remote.down:
            await self.look(pipeline, even_before_start=True)
            await asyncio.sleep(0.5)
        if "trainer" in self.remote.down:
            raise ServiceDied(f"the trainer stopped answering at step {pipeline.train_worker.step}", "trainer")
