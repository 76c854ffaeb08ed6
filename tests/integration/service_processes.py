"""Real service processes for integration tests that drive them by hand:
start any service on free ports (or a given one), wait on a run's files, stop
everything at the end. The controller runs as `python -m services.controller
run` against `services:` addresses, as in a deployment."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from flywheel.launcher.processes import ServiceProcess, start_service
from services.controller.launcher.local_run import EXIT_INTERRUPTED

ROOT = Path(__file__).resolve().parents[2]


def quickstart_tiny() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())


def prepare_tiny_model() -> Path:
    from services.controller.launcher.prepare import prepare_model
    from services.controller.launcher.spec import ModelSource

    return prepare_model(ModelSource(**quickstart_tiny()["launch"]["model"]))


def jsonl(path: Path) -> list[dict]:
    """A JSONL file's records. Tests read these while a service appends to them: a last line not yet
    ended by its newline, and not yet whole, is left out (it is read whole the next time)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return [json.loads(line) for line in lines]


def wait_for(check, timeout: float, what: str, process: subprocess.Popen | None = None,
             output: Path | None = None):
    """The first truthy value of `check()`, polled; fails if `process` (the controller, or any process
    the wait depends on) exits first. `output`: a log whose last lines the failure shows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process exited ({process.returncode}) while waiting for {what}"
                                 f"{log_tail(output)}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{log_tail(output)}")


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last lines of a log, on lines of their own after a colon; empty without one."""
    if path is None or not path.exists():
        return ""
    return ":\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Cluster:
    """Service processes by name, each with its own directory (config, log, ready file)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.services: dict[str, ServiceProcess] = {}

    def start(self, name: str, kind: str, config: dict, port: int = 0, python: str = sys.executable) -> ServiceProcess:
        """`python`: the interpreter to run it with (e.g. a wrapper that enters a network namespace)."""
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        args = ["--config", str(path)] + (["--server.port", str(port)] if port else [])  # a later flag wins
        child = start_service(kind, directory, args, python=python)
        self.services[name] = child
        return child

    def __getitem__(self, name: str) -> ServiceProcess:
        return self.services[name]

    def synchronizer(self, **config: Any) -> str:
        sync = self.start("synchronizer", "synchronizer", {"checkpoint_root": str(self.root), **config})
        sync.wait_ready(60)
        return sync.grpc_address

    def trainer(self, model_dir: Path, synchronizer: str, **overrides: Any) -> ServiceProcess:
        """`overrides`: config sections merged over the defaults (e.g. model={"lora": {...}})."""
        config = {
            "model": {"path": str(model_dir), "cpu_threads": 1},
            "optimizer": {"lr": 1e-4},
            "checkpoint": {"dir": str(self.root / "checkpoints")},
            "sync": {"synchronizer_address": synchronizer},
        }
        for section, values in overrides.items():
            config[section] = {**config.get(section, {}), **values}
        return self.start("trainer", "trainer", config)

    def rollout(self, name: str, model: Path, synchronizer: str, port: int = 0,
                updates: dict[str, Any] | None = None, engine: str = "transformers") -> ServiceProcess:
        """A replica registered as `name`, on the transformers engine by default (light enough for several
        on two cores) or vLLM; `updates`: more of its updates section (a faults file, deadlines)."""
        args: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "seed": 0}
        if engine == "vllm":
            args.update(max_num_seqs=16, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True)
        return self.start(name, "rollout", {
            "http_port": 0,
            "engine": {"kind": engine, "model_path": str(model), "args": args},
            "synchronizer": {"address": synchronizer, "component_id": name.split("@")[0],
                             "heartbeat_interval_seconds": 0.5, "retry_max_seconds": 1.0},
            "updates": {"checkpoint_root": str(self.root), **(updates or {})},
        }, port)

    def tiny_fleet(self, *replicas: str, **rollout: Any) -> tuple[Path, str, ServiceProcess]:
        """The tiny model, a synchronizer, a trainer and the replicas named (each `rollout(name, ...)` with
        `rollout`), all ready: (the model, the synchronizer's address, the trainer)."""
        model = prepare_tiny_model()
        sync = self.synchronizer()
        trainer = self.trainer(model, sync)
        for name in replicas:
            self.rollout(name, model, sync, **rollout)
        for name in ("trainer", *replicas):
            self[name].wait_ready(300)
        return model, sync, trainer

    def teacher(self, name: str, model: Path) -> ServiceProcess:
        """A replica serving `model` as a distillation teacher: standalone (no synchronizer), so the run
        scores on it and never samples from it."""
        return self.start(name, "rollout", {
            "http_port": 0,
            "engine": {"kind": "transformers", "model_path": str(model),
                       "args": {"dtype": "float32", "max_model_len": 256, "seed": 0}},
        })

    def controller(self, run: dict, run_dir: Path, python: str = sys.executable) -> subprocess.Popen:
        run_file = self.root / "run.yaml"
        run_file.write_text(yaml.safe_dump(run))
        out = open(self.root / "controller.out", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            [python, "-m", "services.controller", "run", str(run_file), "--run-dir", str(run_dir)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def controller_output(self) -> str:
        return (self.root / "controller.out").read_text()[-4000:]

    def stop_the_run(self, controller: subprocess.Popen) -> None:
        """As a user's Ctrl-C: the controller stops after a checkpoint and exits EXIT_INTERRUPTED."""
        controller.send_signal(signal.SIGINT)
        assert controller.wait(120) == EXIT_INTERRUPTED, self.controller_output()

    def stop(self) -> None:
        for child in reversed(list(self.services.values())):
            child.stop(grace=5)


def tiny_run(name: str, steps: int, synchronizer: str, trainer: str, **sections: Any) -> dict:
    """The tiny quickstart's run file against `services:` (no rollout list: the registry's replicas)."""
    run = {k: v for k, v in quickstart_tiny().items() if k != "launch"}
    run["launch"] = {"dataset": {"generator": "arithmetic", "train_size": 4 * steps, "validation_size": 4},
                     # With `services:` the controller keeps its configured ports (50054, 9094, 8080): free ones
                     # here, or two tests on make test's two workers collide.
                     "controller": {"status_port": 0, "server": {"port": 0, "metrics_port": 0}}}
    run["run"].update(name=name, max_steps=steps)
    run.update(resume="disable", validation={"before_training": False, "interval": 0},
               checkpoint={"interval": 0, "at_end": False},
               services={"synchronizer": {"address": synchronizer},
                         "trainer": {"address": trainer, "timeout_seconds": 600}, "health_interval_seconds": 0.5})
    run.update(sections)
    return run
