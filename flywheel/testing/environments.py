"""The example OpenEnv environment server (examples/openenv/arithmetic) started as its author runs it,
for the tests and the bench that play it (tests/integration/test_openenv.py, bench/environments.py):
uvicorn from its own virtual environment, .venv-openenv (`make setup`; requirements/openenv.txt),
on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from flywheel.testing.net import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
EXAMPLE = ROOT / "examples" / "openenv" / "arithmetic"


@contextlib.contextmanager
def example_environment(log: Path, ready_seconds: float = 60.0, **env: str) -> Iterator[str]:
    """Serves the example environment while the block runs (`env`: its settings, e.g. ARITHMETIC_ATTEMPTS);
    yields its URL. Its output goes to `log`."""
    if not ENV_PYTHON.exists():
        raise RuntimeError(f"{ENV_PYTHON} is missing: `make setup` makes it (requirements/openenv.txt)")
    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen(
            [str(ENV_PYTHON), "-m", "uvicorn", "server.app:app", "--app-dir", str(EXAMPLE), "--host", "127.0.0.1",
             "--port", str(port)], cwd=EXAMPLE, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_seconds
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the environment server exited ({server.returncode}):\n{log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the environment server did not listen in {ready_seconds:g} s") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
