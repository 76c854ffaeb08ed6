"""Stopping a child's whole process group, even after the child itself died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flywheel.launcher.processes import (
    LAUNCHER_PID_ENV,
    ServiceDied,
    ServiceProcess,
    group_alive,
    tail,
)


def _child(tmp_path: Path) -> ServiceProcess:
    # A leader with a grandchild in its group, like a rollout service and its engine process.
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], process_group=0)
    log = tmp_path / "x.log"
    log.write_text("first\n\n\nlast words\n")
    return ServiceProcess("rollout", process, log, tmp_path / "x.ready.json")


def test_stop_reaches_what_a_killed_child_left_in_its_group(tmp_path):
    child = _child(tmp_path)
    time.sleep(0.5)
    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait()
    assert group_alive(child.process.pid)  # the grandchild lives on
    try:
        child.check_alive()
    except ServiceDied as exc:
        assert "service rollout exited with code -9" in str(exc) and str(exc).endswith("first\nlast words")
    else:
        raise AssertionError("a dead child must raise ServiceDied")
    child.stop(grace=2.0)
    assert not group_alive(child.process.pid)


def test_stop_of_a_running_child_terminates_the_group(tmp_path):
    child = _child(tmp_path)
    time.sleep(0.3)
    assert child.stop(grace=5.0) == -signal.SIGTERM
    assert not group_alive(child.process.pid)


def test_a_group_of_zombies_is_not_alive(tmp_path):
    # Exited but not yet reaped, as an engine's processes are once their parent is gone and until
    # init reaps them: the group still answers a signal, yet nothing in it runs.
    process = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.killpg(process.pid, 0)  # the zombie is still a member of its group
        assert not group_alive(process.pid)
    finally:
        process.wait()


def test_tail_skips_blank_lines(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\n\n \nb\nc\n")
    assert tail(path, 2) == "b\nc"
    assert tail(tmp_path / "missing") == ""


def test_a_started_child_dies_with_its_launcher(tmp_path):
    # launcher -> child as start_service wires them: the pid in the environment, no preexec_fn.
    pid_file = tmp_path / "child.pid"
    child_code = (
        "import os, time; from flywheel.launcher.processes import die_with_launcher; die_with_launcher(); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    launcher_code = (
        "import os, subprocess, sys, time; from flywheel.launcher.processes import LAUNCHER_PID_ENV; "
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}], env={{**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}}); "
        "time.sleep(60)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child_pid)


def test_a_child_whose_launcher_is_already_gone_exits(tmp_path):
    code = "from flywheel.launcher.processes import die_with_launcher; die_with_launcher(); print('ran on')"
    env = {**os.environ, LAUNCHER_PID_ENV: "1"}  # not our parent
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ran on" not in done.stdout
    assert "the launcher (pid 1) exited before this service started" in done.stderr


def _running(pid: int) -> bool:
    # A zombie (reparented, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
