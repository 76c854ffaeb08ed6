"""A run on this machine: prepare, start the services, drive the pipeline, report.

`LocalRun.execute()` is the whole story (see launch.py for the user's view):

    prepare()          model directory + dataset files (cached)
    start_services()   the synchronizer, then trainer and rollout (which register
                       with it) as supervised children
    drive()            the controller pipeline in this process, with progress, served
                       as the controller service (gRPC Status/Stop/StreamMetrics,
                       health, /metrics, the status page: app.py)
    report()           summary.json + progress.png

A `finally` stops every child whatever happened. The pipeline's main loop
runs as a task next to a watcher that checks the children twice a second.
A dead rollout replica is started again while the run goes on; a dead
trainer or synchronizer cancels the loop, surfaces as `ServiceDied`, and the
run rewinds: every service restarted, resumed from the last checkpoint
(launcher/healing.py says why, and how often).

Deployed (`services:` named, nothing started here), the same watcher asks the
services what they hold (launcher/deployed.py): a synchronizer the kubelet
restarted is handed the run's policy and weights again while the run goes
on; a trainer that came back without the run's state surfaces as
`ServiceDied` and the run resumes from the last checkpoint, once the
services answer again; the synchronizer and the replicas, which may hold
versions made by the lost weights, are rewound to the checkpoint's version
(the synchronizer's Rewind) before anything is generated.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.controller.launcher.deployed import Deployment
from services.controller.launcher.healing import Healer, Restart, latest_checkpoint
from services.controller.launcher.ledger import keep_ledger
from services.controller.launcher.prepare import prepare_data, prepare_model
from flywheel.launcher.processes import ServiceDied, interrupt_on
from services.controller.launcher.progress import Progress
from services.controller.launcher.replicas import ReplicaRestarts
from services.controller.launcher.report import write_report
from services.controller.launcher.spec import LaunchSpec, resume_section, run_env_overrides, split_run_file
from services.controller.launcher.supervisor import Supervisor
from services.controller.launcher.tls import LaunchTls
from flywheel.runtime.tls import process_tls
from flywheel.runtime.config import ConfigError, deep_merge, read_config_file, with_run_defaults
from flywheel.runtime.logging import route_root_logging
from services.controller.run_config import RunConfig, ServicesConfig, parse_run_config

log = logging.getLogger("flywheel.launch")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
#: Parent of run directories (the controller service's runs_dir setting).
RUNS_DIR_ENV = "FLYWHEEL_CONTROLLER__RUNS_DIR"
#: The rollout's component id at the synchronizer, and the controller's name for that replica.
ROLLOUT_ID = "rollout-0"


def _configure_file_logging(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    route_root_logging(handler, logging.INFO)


async def _nothing() -> None:
    return None


#: What `drive` imports once the services are up: 2.5 s here, most of it torch (the synchronizer
#: client's codec). Imported while the synchronizer starts, on the core it leaves idle.
_DRIVE_MODULES = ("flywheel.runtime.server", "services.controller.adapters", "services.controller.app",
                  "services.controller.assemble", "services.controller.loop", "services.controller.ops.runs")


def _import_in_background(modules: tuple[str, ...]) -> None:
    """Imports `modules` in a daemon thread; a module that fails to import fails again, with its
    error, where it is used."""
    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported where it is imported for use
                return

    threading.Thread(target=load, daemon=True, name="import-ahead").start()


async def _count_resumed_steps(pipeline: Any) -> None:
    """Makes `run.max_steps` count the trainer's steps, resumed ones included (an after_start hook).

    The pipeline counts the steps of this session; a resumed run would then
    train max_steps more instead of stopping at step max_steps. Setting its
    counter to the trainer's step once the resume is done keeps the numbering
    and the stop where the user configured them.
    """
    step = pipeline.train_worker.step
    pipeline.state.resumed_at_step = pipeline.state.steps_done = step
    if step > 0:  # the checkpoint just loaded is this step's: no need to write it again at the end
        pipeline.state.last_checkpoint_step = step


@dataclass
class LocalRun:
    spec: LaunchSpec
    data: dict[str, Any]
    run_dir: Path
    out: Any = sys.stdout
    supervisor: Supervisor | None = None
    progress: Progress | None = None
    interrupted: int = 0
    #: This session's replicas that exited: started again after a backoff, or given up (launcher/replicas.py).
    replicas: ReplicaRestarts | None = None
    healer: Healer | None = None
    #: The pipeline of the current session (the run's state when a service dies).
    pipeline: Any = None
    #: Sessions driven by this launch: 1, and one more for each rewind.
    sessions: int = 0
    _train_metrics: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    #: When the services answered ready (monotonic; None until then): the job's own time counts from here.
    services_ready: float | None = None
    #: The status page's address once it serves ("" until then).
    status_url: str = ""
    #: launch.tls: the run's throwaway CA, made when services are first started here.
    launch_tls: LaunchTls | None = None
    #: The run file names its services (a deployment): none is started here.
    deployed: bool = False
    #: Deployed: the services the run file names (launcher/deployed.py), set by start_services.
    deployment: Deployment | None = None

    @classmethod
    def from_args(cls, args: Any) -> LocalRun:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"run file {path} does not exist")
        spec, data = split_run_file(read_config_file(path), f"file {path}")
        run = dict(data.get("run") or {})
        if args.max_steps is not None:
            run["max_steps"] = args.max_steps
        if args.resume is not None:
            data["resume"] = resume_section(args.resume)
        if args.seed is not None:
            run["seed"] = args.seed
            if not run.get("output_dir"):
                run["name"] = f"{run.get('name', 'run')}-seed{args.seed}"
        data["run"] = run
        deep_merge(data, run_env_overrides(os.environ))
        runs = Path(os.environ.get(RUNS_DIR_ENV) or "runs")
        run_dir = args.run_dir or (Path(run["output_dir"]) if run.get("output_dir") else runs / run.get("name", "run"))
        run_dir = run_dir.resolve()
        run["output_dir"] = str(run_dir)
        return cls(spec=spec, data=data, run_dir=run_dir)

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.out, flush=True)

    # -- the whole run --------------------------------------------------------
    def execute(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _configure_file_logging(self.run_dir / "controller.log")
        (self.run_dir / "launcher.pid").write_text(f"{os.getpid()}\n")
        # Until the pipeline's own handlers are installed, a signal ends the launch.
        previous = interrupt_on(signal.SIGINT, signal.SIGTERM)
        self.healer = Healer(self.spec.restarts)
        try:
            self.prepare()
            self.deployed = "services" in self.data
            while True:
                try:
                    cfg = self.start_services()
                    if self.services_ready is None:
                        self.services_ready = time.monotonic()
                    code, summary = asyncio.run(self.drive(cfg))
                except ServiceDied as exc:
                    # Only once a run was under way: a service that cannot start at all is a
                    # configuration problem, not something a restart fixes.
                    if not (self.sessions > 0 and self.healer.may_restart()):
                        raise
                    self.rewind(exc)
                    continue
                summary["restarts"] = self.healer.summary()
                self.stop_services(meanwhile=lambda: self.report(cfg, summary))
                return code
        except ServiceDied as exc:
            self.say(f"error: {exc}")
            return EXIT_FAILED
        except KeyboardInterrupt:
            self.say("interrupted: stopping services")
            return EXIT_INTERRUPTED
        except (TimeoutError, FileNotFoundError, ConfigError) as exc:
            self.say(f"error: {exc}")
            return EXIT_FAILED
        except Exception as exc:  # still stop the children, and say where the details are
            log.exception("launch failed")
            self.say(f"error: {type(exc).__name__}: {exc} (see {self.run_dir / 'controller.log'})")
            return EXIT_FAILED
        finally:
            self.stop_services()
            if self.progress is not None:
                self.progress.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def rewind(self, death: ServiceDied) -> None:
        """After `death` of the trainer or the synchronizer (or of any service while a rewind
        starts): stops the others, waits the backoff, and sets the next session to resume from
        the newest checkpoint this launch knows of (healing.py says why not less). The pipeline
        is the last session's: a death while a rewind starts services again keeps its figures."""
        assert self.healer is not None and self.pipeline is not None
        step = self.pipeline.train_worker.step
        if self.pipeline.state.last_checkpoint_path:  # written by the session that just died
            self.data["resume"] = {"from": self.pipeline.state.last_checkpoint_path}
        source = self.data["resume"].get("from", "none")
        if source == "latest" and not self.deployed:
            source = latest_checkpoint(self.run_dir / "checkpoints")
        elif source == "latest":
            # Deployed, the checkpoints are on the trainer's volume: the one this session started from
            # (none when it started at step 0 and wrote none: the run starts over).
            resumed_at = self._resumed_at(self.pipeline)
            source = f"the trainer's newest checkpoint (step {resumed_at})" if resumed_at else ""
        source = "" if source == "none" else source
        name = Path(source).name
        resumed_step = (int(name.removeprefix("global_step_")) if name.removeprefix("global_step_").isdigit()
                        else self._resumed_at(self.pipeline) if source else 0)
        delay = self.healer.backoff()
        restart = self.healer.record(Restart(
            death.service, death.exit_code, step, "resumed" if self.deployed else "rewound", resumed_from=source,
            redo_from_step=resumed_step + 1))
        log.warning("healing: %s (restart %d of at most %d)", restart.describe(), len(self.healer.history),
                    self.healer.policy.max_restarts)
        where = (f"its log: {self.run_dir / (death.service + '.log')}" if not self.deployed
                 else "its own log (kubectl logs --previous)")
        self.say(f"healing: {restart.describe()} (restart {len(self.healer.history)} of at most "
                 f"{self.healer.policy.max_restarts}, in {delay:.0f}s; {where})")
        self.stop_services()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if not self.deployed:  # deployed, the next session's resume rewinds the others (Deployment.rewind)
            self.data.pop("services", None)  # filled in again by start_services with the new children
        time.sleep(delay)

    # -- steps ----------------------------------------------------------------
    def prepare(self) -> None:
        spec = self.spec
        self.say(f"run directory {self.run_dir}")
        self.model_dir: Path | None = None
        if "services" not in self.data:  # remote services load their own model
            t = time.monotonic()
            self.model_dir = prepare_model(spec.model)
            self.say(f"model {self.model_dir} ({time.monotonic() - t:.0f}s)")
            lora = (spec.trainer.get("model") or {}).get("lora") or {}
            if lora.get("enabled") and "lm_head" in (lora.get("target_modules") or ()):
                # An adapter on a head tied to the input embeddings merges into a head of its own, which the
                # tied model the rollout serves has no room for: every update would be refused.
                from flywheel.models.untie import ensure_untied, ties_embeddings

                if ties_embeddings(self.model_dir):
                    self.model_dir = ensure_untied(self.model_dir,
                                                   self.model_dir.with_name(self.model_dir.name + "-untied"))
                    self.say(f"model {self.model_dir}: its output head untied (LoRA adapts lm_head)")
        self.data["data"] = prepare_data(spec.dataset, dict(self.data.get("data") or {}), self.run_dir / "data")
        self.data.setdefault("model", {}).setdefault("name", str(self.model_dir or ""))
        # Validated now, with a placeholder address: a bad field fails before anything starts.
        probe = dict(self.data)
        probe.setdefault("services", {"synchronizer": {"address": "127.0.0.1:1"}})
        parse_run_config(probe, "run file")

    def _thread_share(self) -> int:
        return self.spec.cpu_threads or max(1, (os.cpu_count() or 2) // 2)

    def _trainer_id(self) -> str:
        # The run file names no services here (they would not be started), so it is the default.
        return ServicesConfig.model_fields["trainer_id"].default

    def service_configs(self, synchronizer_address: str) -> dict[str, dict[str, Any]]:
        """The trainer's and the rollout's configs: both register themselves with
        the synchronizer at `synchronizer_address`, under the ids the controller
        names them by (services.trainer_id, services.rollout[].id)."""
        spec, dtype = self.spec, self.spec.model.dtype
        trainer = {
            "model": {"path": str(self.model_dir), "dtype": dtype, "cpu_threads": self._thread_share()},
            "checkpoint": {"dir": str(self.run_dir / "checkpoints")},
            "sync": {"synchronizer_address": synchronizer_address, "trainer_id": self._trainer_id()},
        }
        rollout = {
            "http_port": 0,
            # The engine serves the checkpoint's dtype (its config.json) unless told otherwise.
            "engine": {"model_path": str(self.model_dir)},
            "synchronizer": {"address": synchronizer_address, "component_id": ROLLOUT_ID},
        }
        resume = self.data.get("resume") or {}
        if resume.get("from") not in (None, "none", "latest"):
            # A checkpoint to resume from, named on this machine: the trainer refuses request paths outside
            # the directories it is configured with, so the one holding it is added, and the path made absolute
            # (a relative one would be taken inside the trainer's checkpoint directory).
            source = Path(resume["from"]).absolute()
            self.data["resume"] = {**resume, "from": str(source)}
            trainer["checkpoint"]["allowed_roots"] = [str(source.parent)]
        # CHECKPOINT versions are published under the run directory; the synchronizer and the rollout take
        # the paths they are sent only from there.
        rollout["updates"] = {"checkpoint_root": str(self.run_dir)}
        tls = self._tls_section()
        run, model = self.data.get("run") or {}, {"serve_dtype": spec.model.serve_dtype}
        configs = {"trainer": deep_merge(deep_merge(trainer, tls), spec.trainer),
                   "rollout": deep_merge(deep_merge(rollout, tls), spec.rollout)}
        return {name: with_run_defaults(name, config, run, model) for name, config in configs.items()}

    def _tls_section(self) -> dict[str, Any]:
        """The services' `server.tls` under launch.tls (one CA for the whole launch), else {}."""
        if self.launch_tls is None:
            self.launch_tls = LaunchTls(self.spec.tls, self.run_dir)
        return self.launch_tls.section()

    def start_services(self) -> RunConfig:
        _import_in_background(_DRIVE_MODULES)
        if "services" in self.data:
            self.say("using the services named in the run file")
            cfg = parse_run_config(self.data, "run file")
            self.deployment = Deployment(cfg.services, self.spec.ready_timeout_seconds, self.say, self.healer)
            self.deployment.wait_until_serving()
            return cfg
        self.supervisor = Supervisor(self.run_dir, stop_grace_seconds=self.spec.stop_grace_seconds)
        self.replicas = ReplicaRestarts(self.supervisor, self.healer, self.say)
        self.say(f"starting synchronizer, then trainer and rollout (logs: {self.run_dir}/<service>.log)")
        t = time.monotonic()
        deadline = t + self.spec.ready_timeout_seconds
        # First, and alone: the trainer and the rollout register with it as soon as they are loaded.
        synchronizer_config = deep_merge({"checkpoint_root": str(self.run_dir), **self._tls_section()},
                                         dict(self.spec.synchronizer))
        self.supervisor.start("synchronizer", synchronizer_config)
        self.supervisor.wait_ready(self.spec.ready_timeout_seconds)
        synchronizer = self.supervisor.child("synchronizer").grpc_address
        # The two slow ones load their models in parallel.
        for name, config in self.service_configs(synchronizer).items():
            self.supervisor.start(name, config)
        self.supervisor.wait_ready(max(1.0, deadline - time.monotonic()))
        addresses = {c.name: c.grpc_address for c in self.supervisor.children}
        self.say(
            f"services ready in {time.monotonic() - t:.0f}s: "
            + ", ".join(f"{n} {a}" for n, a in addresses.items())
        )
        # No rollout list: replicas are the ones registered with the synchronizer.
        self.data["services"] = {
            "synchronizer": {"address": synchronizer},
            "trainer": {"address": addresses["trainer"], "timeout_seconds": 900.0},
            "trainer_id": self._trainer_id(),
        }
        return parse_run_config(self.data, "run file")

    def stop_services(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Stops the services started here; `meanwhile` (the report, which needs none of them) runs
        while they stop, which takes a second."""
        if self.supervisor is None:
            if meanwhile is not None:
                meanwhile()
            return
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="stop-services") as pool:
                stopping = pool.submit(self.supervisor.stop)
                if meanwhile is not None:
                    meanwhile()
                codes = stopping.result()
        finally:
            self.supervisor, self.replicas = None, None
        log.info("services stopped: %s", codes)
        self.say("stopped " + ", ".join(f"{n} (exit {c})" for n, c in codes.items()))

    # -- the pipeline ---------------------------------------------------------
    def controller_config(self) -> Any:
        """This process's ControllerConfig: launch.controller < FLYWHEEL_CONTROLLER__* variables.

        Started here, the services are this run's alone, so the controller's
        gRPC and /metrics ports default to free ones, and a busy status page
        port falls back to a free one when the page binds it (`drive`; the URL
        is printed). With `services:` (containers) the configured ports are
        used as they are: probes and Prometheus look for them there.
        """
        from flywheel.runtime.config import resolve
        from flywheel.runtime.entry import env_prefix
        from services.controller.config import ControllerConfig

        local = self.supervisor is not None
        base = deep_merge(deep_merge({"server": {"port": 0, "metrics_port": 0}}, self._tls_section()) if local else {},
                          self.spec.controller)
        return resolve(ControllerConfig, env_prefix=env_prefix("controller"), base=base)

    async def drive(self, cfg: RunConfig) -> tuple[int, dict[str, Any]]:
        from flywheel.runtime.server import serve
        from services.controller.adapters import connect
        from services.controller.app import service_spec
        from services.controller.assemble import build_pipeline
        from services.controller.loop import run
        from services.controller.telemetry.metrics_log import PrometheusSink
        from services.controller.ops.runs import RunManager
        from services.controller.ops.status_page import status_link

        controller = self.controller_config()
        services = connect(cfg)
        pipeline = build_pipeline(cfg, services, run_dir=self.run_dir, sinks=[PrometheusSink()])
        self.pipeline, self.sessions = pipeline, self.sessions + 1
        ledger = keep_ledger(self.run_dir, f"{os.getpid()}-{int(time.time())}-{self.sessions}", pipeline)
        pipeline.hooks.after_start.append(_count_resumed_steps)
        if self.deployment is not None:
            self.deployment.rewind_on_resume(pipeline)
        self.progress = Progress(cfg.run.max_steps, self.out)
        close_watch = self.deployment.watch() if self.deployment is not None else _nothing
        for restart in self.healer.history if self.healer else []:  # the status page lists them with the errors
            pipeline.errors.report("launcher", restart.describe(), severity="warning")
        # The controller service around this run: Status, StreamMetrics and Stop
        # over gRPC, health, /metrics and the status page, as deployed.
        runs = RunManager(controller.runs_dir, connect)
        run_task = asyncio.ensure_future(run(pipeline))
        runs.adopt(self.run_dir.name, self.run_dir, pipeline, run_task)
        stop_serving = asyncio.Event()
        served = asyncio.get_running_loop().create_future()

        def page_ready(port: int) -> None:
            host = controller.server.host
            shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            self.status_url = f"{'https' if process_tls().serving else 'http'}://{shown}:{port}/"
            (self.run_dir / "status_url").write_text(self.status_url + "\n")  # no token: files outlive runs
            self.say(f"status page: {status_link(self.status_url, controller.server)}")

        def on_ready(running: Any) -> None:
            if not served.done():
                served.set_result(running)

        server = asyncio.ensure_future(serve(
            # Started here, a run's status page takes a free port when its own is another run's: two
            # runs started at once both check 8080 free and find it taken when they bind it.
            service_spec(controller, runs, on_status_page=page_ready,
                         free_status_port_if_taken=self.supervisor is not None), controller.server,
            stop=stop_serving, on_ready=on_ready, handle_signals=False,
        ))
        try:
            await asyncio.wait([served, server], return_when=asyncio.FIRST_COMPLETED)
            if server.done():  # could not bind or start: say why, and stop the run
                run_task.cancel()
                await asyncio.gather(run_task, return_exceptions=True)
                server.result()
            return await self._supervise(pipeline, run_task)
        finally:
            stop_serving.set()
            await asyncio.gather(server, return_exceptions=True)
            if services.close is not None:
                await services.close()
            await close_watch()
            ledger.close()

    async def _supervise(self, pipeline: Any, run_task: asyncio.Future) -> tuple[int, dict[str, Any]]:
        """Watches the main loop `run_task` beside the children and the signals."""
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            self.interrupted += 1
            if self.interrupted == 1:
                self.say("stopping after a checkpoint (again to stop at once)")
                pipeline.state.checkpoint_on_stop = True
                pipeline.state.stop_requested.set()
            else:
                self.say("stopping now, without a checkpoint")
                run_task.cancel()

        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, on_signal)
        try:
            while not run_task.done():
                await asyncio.wait([run_task], timeout=0.5)
                self._check_children()
                if self.replicas is not None:
                    await self.replicas.restart_due()
                if self.deployment is not None:
                    await self.deployment.look(pipeline)
                self._draw(pipeline)
            summary = run_task.result()
            self._check_children()  # a child's death may have ended the run first
            if pipeline.errors.should_stop and not self.interrupted:
                await self._diagnose(pipeline)
        except ServiceDied:
            run_task.cancel()
            await asyncio.gather(run_task, return_exceptions=True)
            raise
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            return EXIT_INTERRUPTED, {"stop_reason": "interrupted"}
        except Exception as exc:
            # A service that died is the better explanation of a failed RPC.
            await asyncio.sleep(1.0)
            self._check_children()
            await self._diagnose(pipeline)
            log.exception("run failed")
            self.say(f"error: the run failed: {type(exc).__name__}: {exc} (see {self.run_dir / 'controller.log'})")
            return EXIT_FAILED, {"stop_reason": f"{type(exc).__name__}: {exc}", "exit_code": EXIT_FAILED}
        finally:
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(s)
        failed = pipeline.errors.should_stop
        self._draw(pipeline)
        self.progress.close()
        for record in pipeline.errors.recent(5) if failed else []:
            self.say(f"error: {record.module}: {record.message}")
        self.say(f"run ended: {summary.stop_reason} ({summary.steps - self._resumed_at(pipeline)} steps this session)")
        code = EXIT_FAILED if failed else EXIT_INTERRUPTED if self.interrupted else EXIT_OK
        return code, {
            "stop_reason": summary.stop_reason,
            "steps_this_session": summary.steps - self._resumed_at(pipeline),
            "samples_per_second": summary.samples_per_second,
            "trainer_idle_fraction": summary.trainer_idle_fraction,
            "final_version": summary.final_version,
            "checkpoint_this_session": pipeline.state.last_checkpoint_path,
            "dropped": dict(pipeline.processor.dropped),
            "rollouts": dict(pipeline.rollouts.stats),
            "worker": dict(getattr(pipeline.rollouts.worker, "stats", {})),
            "exit_code": code,
        }

    @staticmethod
    def _resumed_at(pipeline: Any) -> int:
        return pipeline.state.resumed_at_step

    def _check_children(self) -> None:
        """A dead trainer or synchronizer raises ServiceDied (the run rewinds, see execute); a dead
        rollout replica does not: the synchronizer drops it, its requests go to the others, and it is
        started again after the backoff (or, out of restarts, left dead)."""
        if self.replicas is not None:  # set with the supervisor of the services started here
            self.replicas.check(self.pipeline)

    async def _diagnose(self, pipeline: Any) -> None:
        """The run failed: a dead service is the better explanation (ServiceDied)."""
        if self.deployment is not None:
            await self.deployment.diagnose(pipeline)

    def _draw(self, pipeline: Any, status: str = "") -> None:
        assert self.progress is not None
        validator = pipeline.validator
        val = None
        if validator is not None and validator.history:
            latest = validator.history[-1][1]
            val = latest.get("val/accuracy", latest.get("val/reward"))
        status = status or ("validating" if pipeline.rollouts.paused and validator is not None else "")
        latest = pipeline.memory.latest()
        if "rollout/reward_mean" in latest:  # validation rows carry val/* only
            self._train_metrics = latest
        self.progress.update(pipeline.train_worker.step, self._train_metrics, val, status)

    def report(self, cfg: RunConfig, summary: dict[str, Any]) -> None:
        checkpoint = summary.get("checkpoint_this_session") or latest_checkpoint(self.run_dir / "checkpoints")
        report = write_report(
            self.run_dir, name=cfg.run.name, summary=summary, checkpoint=checkpoint,
            wall_seconds=time.monotonic() - self.started,
            job_seconds=None if self.services_ready is None else time.monotonic() - self.services_ready,
        )
        val = report["validation"]
        if val["before"] and val["after"]:
            self.say(
                f"{val['metric']}: {val['before']['value']:.3f} (step {val['before']['step']}) -> "
                f"{val['after']['value']:.3f} (step {val['after']['step']})"
            )
        self.say(f"checkpoint: {report['model'] or '(none)'}")
        if report["job_seconds_this_session"] is not None:
            self.say(f"run time: {report['job_seconds_this_session'] / 60:.1f} min from the services being ready")
        self.say(f"summary: {self.run_dir / 'summary.json'}" + (f", plot: {report['plot']}" if report["plot"] else ""))
