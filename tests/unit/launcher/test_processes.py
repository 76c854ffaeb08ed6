"""Stopping a child's whole process group, even after the child itself died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flywheel.launcher.processes import (
    ServiceDied,
    ServiceProcess,
    _die_with_parent,
    group_alive,
    tail,
)


def _child(tmp_path: Path) -> ServiceProcess:
    # A leader with a grandchild in its group, like a rollout service and its engine process.
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], preexec_fn=_die_with_parent)  # noqa: PLW1509 (one thread)
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


def test_tail_skips_blank_lines(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\n\n \nb\nc\n")
    assert tail(path, 2) == "b\nc"
    assert tail(tmp_path / "missing") == ""
