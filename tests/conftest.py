"""Shared fixtures: real service processes on free ports, and tiny models."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flywheel.launcher.processes import ServiceProcess, start_service

TEST_TOKEN = "test-token-123"


@pytest.fixture
def service_env() -> dict[str, str]:
    """The environment children get: ours, minus any Flywheel settings, plus a known token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    return env


@pytest.fixture
def run_service(tmp_path: Path, service_env: dict[str, str]) -> Iterator[Callable[..., ServiceProcess]]:
    """Starts `python -m services.<name>` and waits until it is SERVING; stops it afterwards."""
    started: list[ServiceProcess] = []

    def run(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> ServiceProcess:
        child = start_service(name, tmp_path / "run", args, env or service_env)
        started.append(child)
        child.wait_ready(timeout)
        return child

    yield run
    for child in started:
        child.stop()
