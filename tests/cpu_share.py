"""How much of the machine each test module keeps busy: its wall time beside the CPU time of this
process and of every process it started and reaped (services, their engines, benches), so that a
module that mostly waits can be told from one that is bound by the CPU (what decides whether running
it beside another is faster on two cores). Processes other sessions run are not counted.

    FLYWHEEL_TEST_CPU_REPORT=cpu.tsv .venv/bin/python -m pytest   # one line per module, slowest first
    FLYWHEEL_TEST_CPU_REPORT=cpu.tsv make test                    # cpu.tsv.gw0, cpu.tsv.gw1: one per worker

Off (nothing measured) unless the variable names a file.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest

from tests.preloaded import interpreter_cpu_seconds

REPORT_ENV = "FLYWHEEL_TEST_CPU_REPORT"

_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # Services started as forks of the preloaded interpreter are its children, not ours.
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + interpreter_cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not os.environ.get(REPORT_ENV):
        yield
        return
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield  # setup, call and teardown: a module's fixtures stop their services in its last test's teardown
    module = item.nodeid.split("::")[0]
    _wall[module] += time.monotonic() - wall
    _cpu[module] += _cpu_seconds() - cpu
    _tests[module] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or not _wall:
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker:  # under pytest-xdist (make test) each worker counts its own processes: one file each
        path = f"{path}.{worker}"
    lines = ["module\ttests\twall_s\tcpu_s\tcpu_per_wall"]
    for module in sorted(_wall, key=_wall.get, reverse=True):
        lines.append(f"{module}\t{_tests[module]}\t{_wall[module]:.1f}\t{_cpu[module]:.1f}\t"
                     f"{_cpu[module] / max(_wall[module], 1e-9):.2f}")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")
