"""The preloaded interpreter (flywheel/launcher/preloaded.py): a child it forks is what `python -m`
would have run, it refuses what its imports cannot honour, and no child outlives its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.launcher.preloaded import differing_import_settings, spawn
from flywheel.launcher.processes import LAUNCHER_PID_ENV

#: A module a child runs: it reports what it was given and sees, then exits with its first argument.
REPORTER = textwrap.dedent("""
    import json, os, sys, torch
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("REPORTER_MARKER"),
                      "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "name": __name__,
                      "seed": torch.initial_seed(), "cmdline": open("/proc/self/cmdline").read(),
                      "write_through": sys.stdout.write_through}))
    sys.stdout.flush()
    if sys.argv[1] == "sleep":
        import time
        time.sleep(300)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture(scope="module")
def preloaded() -> Iterator[tuple[str, subprocess.Popen]]:
    directory = Path(tempfile.mkdtemp(prefix="fw-preload-test-"))
    socket_path = str(directory / "socket")
    process = subprocess.Popen(
        [sys.executable, "-m", "flywheel.launcher.preloaded", socket_path], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())},
    )
    assert b"ready" in process.stdout.readline()  # after its imports
    yield socket_path, process
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0


@pytest.fixture
def reporter_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "reporter_module.py").write_text(REPORTER)
    monkeypatch.chdir(tmp_path)  # `-m` finds the module in the working directory, which the child is given
    return tmp_path


def run_reporter(socket_path: str, directory: Path, *args: str, env: dict | None = None):
    out = directory / f"out-{time.monotonic_ns()}"
    with open(out, "wb") as sink:
        child = spawn("reporter_module", args, env or {**os.environ, "REPORTER_MARKER": "mine"},
                      stdout=sink.fileno(), stderr=sink.fileno(), socket_path=socket_path)
    return child, out


def report(out: Path, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(out.read_text().splitlines()[0])


def test_a_child_runs_the_module_as_python_dash_m_would(preloaded, reporter_dir: Path) -> None:
    socket_path, interpreter = preloaded
    child, out = run_reporter(socket_path, reporter_dir, "3", "--flag", "a b")
    assert child is not None
    assert child.wait(60) == 3 and child.poll() == 3
    seen = report(out)
    assert seen["argv"] == ["3", "--flag", "a b"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(reporter_dir) and seen["marker"] == "mine"
    assert seen["pid"] == child.pid == seen["pgid"], "a process group of its own, as the launcher's children"
    assert seen["ppid"] == interpreter.pid
    assert "-m reporter_module 3 --flag a b" in seen["cmdline"], "`ps` names the service, not the preloader"
    assert seen["write_through"] == bool(os.environ.get("PYTHONUNBUFFERED"))

    second, out2 = run_reporter(socket_path, reporter_dir, "0")
    assert second.wait(60) == 0
    assert report(out2)["seed"] != seen["seed"], "each child draws its own seeds"


def test_a_signal_is_reported_as_popen_reports_it(preloaded, reporter_dir: Path) -> None:
    child, out = run_reporter(preloaded[0], reporter_dir, "sleep")
    report(out)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # after its exit: nothing is signalled (its pid may be another process's by now)


def test_a_request_its_imports_cannot_honour_is_refused(preloaded, reporter_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "7" if os.environ.get("OMP_NUM_THREADS") != "7" else "6"}
    child, _ = run_reporter(preloaded[0], reporter_dir, "0", env=env)
    assert child is None, "the launcher starts a fresh interpreter instead"
    assert spawn("reporter_module", ["0"], os.environ, 1, 2, socket_path=str(reporter_dir / "none")) is None


def test_which_settings_need_a_fresh_interpreter() -> None:
    imported_with = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOME": "/root"}
    assert differing_import_settings(imported_with, imported_with) == []
    assert differing_import_settings({**imported_with, "HOME": "/x", "FLYWHEEL_AUTH_TOKEN": "t"}, imported_with) == []
    assert differing_import_settings({"PYTHONUNBUFFERED": "1", "HOME": "/root"}, imported_with) == ["OMP_NUM_THREADS"]
    assert differing_import_settings({**imported_with, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": ""},
                                     imported_with) == ["HF_HUB_OFFLINE"]
    # What a launcher that imported vLLM passes on (vLLM sets it in its own process), and one the imports set.
    assert differing_import_settings({**imported_with, "TORCHINDUCTOR_COMPILE_THREADS": "1"}, imported_with) == []
    inductor = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    assert differing_import_settings(imported_with, imported_with, inductor) == []
    assert differing_import_settings({**imported_with, **inductor}, imported_with, inductor) == []
    assert differing_import_settings({**imported_with, "TORCHINDUCTOR_CACHE_DIR": "/y"}, imported_with,
                                     inductor) == ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_child_does_not_outlive_the_launcher_that_asked_for_it(preloaded, reporter_dir: Path) -> None:
    """Its launcher SIGKILLed: the child gets SIGTERM, as PR_SET_PDEATHSIG gives the launcher's own."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from flywheel.launcher.preloaded import spawn
        child = spawn("reporter_module", ["sleep"], os.environ, 1, 2, socket_path={preloaded[0]!r})
        print(child.pid, flush=True)
        time.sleep(300)
    """)], cwd=reporter_dir, stdout=subprocess.PIPE)
    pid = int(launcher.stdout.readline())
    os.kill(pid, 0)
    launcher.kill()
    launcher.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"child {pid} outlived its launcher")


def test_stopping_the_preloaded_interpreter_stops_its_children(reporter_dir: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="fw-preload-test-"))
    socket_path = str(directory / "socket")
    interpreter = subprocess.Popen([sys.executable, "-m", "flywheel.launcher.preloaded", socket_path],
                                   stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert b"ready" in interpreter.stdout.readline()
    child, out = run_reporter(socket_path, reporter_dir, "sleep")
    report(out)
    interpreter.send_signal(signal.SIGTERM)
    assert interpreter.wait(30) == 0
    assert child.wait(5) == -signal.SIGTERM
