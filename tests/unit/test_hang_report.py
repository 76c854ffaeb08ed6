"""A test about to time out says what its event loop's tasks wait for (tests/hang_report.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from tests.hang_report import _running_loops, tasks_report

ROOT = Path(__file__).resolve().parents[2]


async def _waits_for_an_event_nobody_sets() -> None:
    await asyncio.Event().wait()


def test_the_report_names_the_await_of_each_pending_task() -> None:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    task: list[asyncio.Task] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(_waits_for_an_event_nobody_sets()))
        loop.call_soon(started.set)
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        assert loop in _running_loops()
        report = tasks_report([loop])
        assert "1 pending task(s)" in report and "_waits_for_an_event_nobody_sets" in report, report
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_hung_asyncio_test_reports_its_tasks_before_pytest_timeout_ends_it(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent("""
        import asyncio
        import pytest

        async def the_wait_that_never_ends():
            await asyncio.Event().wait()

        @pytest.mark.timeout(6)
        async def test_hangs():
            await the_wait_that_never_ends()
    """))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.hang_report",
         "-o", "asyncio_mode=auto", str(tmp_path / "test_hangs.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Timeout" in output, output[-3000:]
    assert "test_hangs.py::test_hangs is about to time out" in output, output[-3000:]
    assert "the_wait_that_never_ends" in output, output[-3000:]
