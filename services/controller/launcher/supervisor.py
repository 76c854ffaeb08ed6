"""A group of service children that lives and dies together.

`Supervisor.start(name, config)` writes the child's config to
`<run_dir>/<name>.yaml` and starts it on free ports (processes.py);
`wait_ready()` waits for all of them at once (they load models in
parallel); `check()` raises `ServiceDied` naming the first child that exited,
with the last lines of its log; `stop()` stops every child (the first one
started last), SIGTERM then SIGKILL after a grace period, and is safe to
call twice.
`restart(name)` replaces a child that died with a new one on the same ports.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from flywheel.launcher.processes import ServiceDied, ServiceProcess, start_service, tail


class Supervisor:
    def __init__(self, run_dir: Path, *, stop_grace_seconds: float = 20.0, env: Mapping[str, str] | None = None) -> None:
        self.run_dir, self.grace, self.env = Path(run_dir), stop_grace_seconds, env
        self.children: list[ServiceProcess] = []

    def start(self, name: str, config: Mapping[str, Any]) -> ServiceProcess:
        path = self.run_dir / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        child = start_service(name, self.run_dir, ["--config", str(path)], env=self.env)
        self.children.append(child)
        return child

    def restart(self, name: str, config_overrides: Mapping[str, Any] | None = None) -> ServiceProcess:
        """Starts `name` again with its config file (updated by `config_overrides`) on the ports the
        dead one had: the other services and the controller hold its address. Whatever the dead
        child left running in its process group (an engine worker) is stopped first."""
        old = self.child(name)
        old.stop(grace=0.0)  # its leader is dead: what is left of its group serves nothing
        path = self.run_dir / f"{name}.yaml"
        config = yaml.safe_load(path.read_text()) or {}
        if config_overrides:
            config.update(config_overrides)
            path.write_text(yaml.safe_dump(config, sort_keys=False))
        child = start_service(
            name, self.run_dir, ["--config", str(path)], env=self.env,
            port=old.info.get("grpc_port", 0), metrics_port=old.info.get("metrics_port", 0),
        )
        child.info = dict(old.info)  # the same ports; a later restart takes them from here again
        self.children[self.children.index(old)] = child
        return child

    def child(self, name: str) -> ServiceProcess:
        return next(c for c in self.children if c.name == name)

    def wait_ready(self, timeout: float, on_wait=None) -> None:
        """Every child SERVING (ready file written) within `timeout` seconds, or
        ServiceDied / TimeoutError naming the one that failed."""
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        while pending:
            for child in list(pending):
                child.check_alive()
                if child.ready_path.exists():
                    child.wait_ready(5.0)  # reads the ready file
                    pending.remove(child)
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                logs = "\n".join(f"--- {c.log_path}:\n{tail(c.log_path)}" for c in pending)
                raise TimeoutError(f"service(s) {names} not ready after {timeout:.0f}s\n{logs}")
            if on_wait is not None:
                on_wait([c.name for c in pending])
            time.sleep(0.1)

    def check(self, expendable: Collection[str] = ()) -> None:
        """Raises ServiceDied for the first child that is no longer running, unless it is `expendable`."""
        for child in self.children:
            if child.name not in expendable:
                child.check_alive()

    def dead(self) -> list[str]:
        return [c.name for c in self.children if c.process.poll() is not None]

    def pids(self) -> list[int]:
        return [c.process.pid for c in self.children]

    def stop(self) -> dict[str, int]:
        """Stops every child; their exit codes by name, newest first. The first one started (the
        synchronizer, which the others tell as they stop) goes last; the others together, since each
        takes a second or more to shut down and none waits on another."""
        first, rest = self.children[:1], self.children[1:]
        codes: dict[str, int] = {}
        if rest:
            with ThreadPoolExecutor(len(rest), thread_name_prefix="stop") as pool:
                stopped = list(pool.map(lambda child: child.stop(self.grace), rest))
            codes.update((child.name, code) for child, code in reversed(list(zip(rest, stopped))))
        for child in first:
            codes[child.name] = child.stop(self.grace)
        return codes


__all__ = ["ServiceDied", "Supervisor"]
