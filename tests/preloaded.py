"""Each process that runs tests starts its services as forks of a preloaded interpreter
(flywheel/launcher/preloaded.py): the suite starts some 250 trainers, rollouts and synchronizers, and
each fresh one spent its first 1.5-4 s of a core importing torch and transformers again.

It is started when pytest configures (beside collection, so that nobody waits for its imports), and
named to every launcher through the environment: the tests' own `start_service` calls, and the local
runs, benches and `flywheel up` they start as processes. Until it is ready a launcher starts a fresh
interpreter, as it does for a request the preloaded one refuses (another interpreter, or other
import-time settings: `IMPORT_SETTINGS`).

    FLYWHEEL_TEST_FRESH_INTERPRETERS=1 make test     # every service a fresh interpreter, as before
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flywheel.launcher.preloaded import PRELOADED_ENV
from flywheel.launcher.processes import LAUNCHER_PID_ENV

FRESH_ENV = "FLYWHEEL_TEST_FRESH_INTERPRETERS"

_interpreter: subprocess.Popen | None = None
_directory: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _interpreter, _directory
    controls_workers = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if controls_workers or os.environ.get(FRESH_ENV) or os.environ.get(PRELOADED_ENV):
        return
    # Its own short directory: a socket's path may not exceed 107 bytes, and pytest's tmp paths are long.
    _directory = Path(tempfile.mkdtemp(prefix="flywheel-preloaded-"))
    socket_path = _directory / "socket"
    with open(_directory / "log", "ab") as log:
        _interpreter = subprocess.Popen(
            [sys.executable, "-m", "flywheel.launcher.preloaded", str(socket_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}, process_group=0,
        )
    os.environ[PRELOADED_ENV] = str(socket_path)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _interpreter
    if _interpreter is None:
        return
    os.environ.pop(PRELOADED_ENV, None)
    _interpreter.send_signal(signal.SIGTERM)  # it stops what it still runs, then itself
    try:
        _interpreter.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(_interpreter.pid, signal.SIGKILL)
        _interpreter.wait()
    _interpreter = None
    if _directory is not None:
        from tests.cpu_share import REPORT_ENV  # (that module reads this one's figures at import)

        report = os.environ.get(REPORT_ENV)  # beside the report: how many it started, what it refused
        if report:
            worker = getattr(config, "workerinput", {}).get("workerid")
            shutil.copy(_directory / "log", f"{report}.preloaded{'.' + worker if worker else ''}.log")
        shutil.rmtree(_directory, ignore_errors=True)


def interpreter_cpu_seconds() -> float:
    """CPU time of the preloaded interpreter and of the children it has reaped so far (the services it
    started, which are not this process's children): 0 where there is none."""
    if _interpreter is None:
        return 0.0
    try:
        stat = Path(f"/proc/{_interpreter.pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2:].split()
    # utime, stime, cutime, cstime: fields 14-17 of the line, 12-15 after "pid (comm) ".
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
