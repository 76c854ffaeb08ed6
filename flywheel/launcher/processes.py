"""Starting a service as a child process and knowing when it is ready.

A child is started as `python -m services.<name>` on free ports (port 0) with
a ready file; it is ready when that file appears (the service writes it only
after reporting SERVING). Its output goes to `<run_dir>/<name>.log`. Children
get their own process group so a stop reaches anything they spawned, and the
parent's death is noticed by `PR_SET_PDEATHSIG` on Linux so none is orphaned. Where a preloaded
interpreter is set up (preloaded.py: the test suite's), the child is a fork of it instead, started alike.

No Python code runs between fork and exec (no `preexec_fn`): the parent holds
live gRPC channels, and gRPC's fork handlers running in a half-made child
restart pollers on descriptors the exec is about to close, which aborted
children at random. The child sets its own death signal instead, first thing
(`die_with_launcher`), told the launcher's pid by `LAUNCHER_PID_ENV`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.launcher.preloaded import PreloadedChild, spawn

SERVICES = ("synchronizer", "trainer", "rollout", "controller")
#: Services started only when asked for (`flywheel up --with tinker`).
OPTIONAL_SERVICES = ("tinker",)


class ServiceDied(RuntimeError):
    """A child exited; the message names it and ends with its last log lines."""

    def __init__(self, message: str, service: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.service, self.exit_code = service, exit_code


#: Set in a child's environment to the pid of the launcher that started it.
LAUNCHER_PID_ENV = "FLYWHEEL_LAUNCHER_PID"


def die_with_launcher() -> None:
    """In a started child: get SIGTERM when the launcher dies, or exit now if it
    already has (it may die between the spawn and this call)."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)  # not inherited by the child's own children
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):
        sys.exit(f"the launcher (pid {launcher}) exited before this service started")


def interrupt_on(*signals: int) -> dict[int, Any]:
    """In a launcher's main thread: each of `signals` raises KeyboardInterrupt, as Ctrl-C does, so its
    `finally` stops the children and says so. Set whatever the process inherited: a shell starts a
    background job with SIGINT ignored (and Python then leaves it ignored), and a supervisor stops with
    SIGTERM, whose default would end the launcher at once, its children told only by their death signal.
    Returns the handlers it replaced, to put back."""
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, _raise_interrupt)
    return previous


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def tail(path: Path, lines: int = 20) -> str:
    try:
        # Blank lines (progress-bar redraws) would crowd out the informative ones.
        kept = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return "\n".join(kept[-lines:])
    except OSError:
        return ""


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen | PreloadedChild
    log_path: Path
    ready_path: Path
    info: dict = field(default_factory=dict)

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.info['grpc_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.info['metrics_port']}/metrics"

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ServiceDied(
                f"service {self.name} exited with code {code}; last lines of {self.log_path}:\n{tail(self.log_path)}",
                self.name, code,
            )

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.ready_path.exists():
                self.info = json.loads(self.ready_path.read_text())
                return self.info
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"service {self.name} not ready after {timeout:.0f}s; log tail:\n{tail(self.log_path)}")

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM the child's process group, SIGKILL it after `grace` seconds.

        The group is signalled even when the child itself already exited: a
        child killed outright leaves its own children (an inference engine's
        worker, say) running in its group, and they must not outlive the run.
        """
        pgid = self.process.pid  # the child called setpgrp: its pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        if self.process.poll() is None:
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.process.wait()
        deadline = time.monotonic() + min(grace, 5.0)
        while group_alive(pgid):
            if time.monotonic() > deadline:
                _signal_group(pgid, signal.SIGKILL)
                break
            time.sleep(0.1)
        return self.process.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs. A zombie does not count: it holds nothing
    but its process table entry, and once its parent is gone only init reaps it, when it gets to
    it (seconds later in containers whose init reaps by polling: every vLLM rollout's stop
    waited 5 s for its engine's zombies)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = _group_states(pgid)
    return members is None or any(state != "Z" for state in members)


def _group_states(pgid: int) -> list[str] | None:
    """The states (R, S, Z...) of the processes of group `pgid`, from /proc; None where there is no /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    states = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            states.append(fields[0])
    return states


def start_service(
    name: str,
    run_dir: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    *,
    port: int = 0,
    metrics_port: int = 0,
) -> ServiceProcess:
    """Starts `python -m services.<name>` on the given ports (0: free ones); call `wait_ready` next.

    A restarted child is given its predecessor's ports: the others hold its address."""
    if name not in SERVICES + OPTIONAL_SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {SERVICES + OPTIONAL_SERVICES}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ready_path = run_dir / f"{name}.ready.json"
    ready_path.unlink(missing_ok=True)
    log_path = run_dir / f"{name}.log"
    module = f"services.{name}"
    service_args = [
        "--server.port", str(port), "--server.metrics-port", str(metrics_port), "--server.ready-file", str(ready_path),
        *args,
    ]  # fmt: skip
    env = os.environ if env is None else env
    with open(log_path, "ab") as log:
        process: subprocess.Popen | PreloadedChild | None = None
        if python == sys.executable:  # a fork of the preloaded interpreter, where one is set up (preloaded.py)
            process = spawn(module, service_args, env, stdout=log.fileno(), stderr=log.fileno())
        if process is None:
            process = subprocess.Popen(
                [python, "-m", module, *service_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**env, LAUNCHER_PID_ENV: str(os.getpid())},
                process_group=0,  # its own group, set without running Python in the child
            )
    return ServiceProcess(name=name, process=process, log_path=log_path, ready_path=ready_path)
