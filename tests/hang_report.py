"""What a test that hangs in an event loop was waiting for.

pytest-timeout ends a test that outlives its limit and prints every thread's
stack; for an asyncio test those all end in the loop's `select`, idle, and say
nothing of the coroutine that waits. Here one watchdog thread per process
notes when each test started (its setup, as pytest-timeout counts it) and,
`LEAD_SECONDS` before its timeout, writes the stack of every pending task of
every running event loop to stderr, once: pytest shows it with the test's
failure (captured output), where the await that never returned is named.
"""

from __future__ import annotations

import asyncio
import gc
import io
import sys
import threading
import time
from collections.abc import Iterator

import pytest

#: Seconds before the test's timeout at which the tasks are written out.
LEAD_SECONDS = 30.0
#: How often the watchdog looks.
POLL_SECONDS = 2.0

_current: dict[str, object] = {}  # "test", "deadline", "reported"
_lock = threading.Lock()


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    return [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]


def tasks_report(loops: list[asyncio.AbstractEventLoop]) -> str:
    """Every pending task of `loops`, with the stack of its coroutine (read from this thread while the
    loop waits: a hung loop is idle in select)."""
    out = io.StringIO()
    for loop in loops:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        except RuntimeError:  # the set changed while it was read: the loop is not idle after all
            continue
        out.write(f"--- {len(tasks)} pending task(s) of event loop {id(loop):#x}\n")
        for task in tasks:
            task.print_stack(limit=12, file=out)
    return out.getvalue()


def _watch() -> None:
    while True:
        time.sleep(POLL_SECONDS)
        with _lock:
            test, deadline, reported = _current.get("test"), _current.get("deadline"), _current.get("reported")
        if test is None or reported or deadline is None or time.monotonic() < float(deadline):  # type: ignore[arg-type]
            continue
        with _lock:
            if _current.get("test") != test:
                continue
            _current["reported"] = True
        report = tasks_report(_running_loops())
        sys.stderr.write(f"\n=== {test} is about to time out; what its event loops wait for:\n{report or '(no running loop)'}\n")
        sys.stderr.flush()


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout is not installed: no timeout to report before
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    timeout = _timeout_of(item)
    with _lock:
        _current.update(test=item.nodeid, reported=False,
                        deadline=time.monotonic() + max(timeout - LEAD_SECONDS, timeout / 2) if timeout else None)
    try:
        yield
    finally:
        with _lock:
            _current.update(test=None, deadline=None)


def pytest_configure(config: pytest.Config) -> None:
    threading.Thread(target=_watch, daemon=True, name="hang-report").start()
