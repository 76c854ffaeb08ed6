"""flywheel/runtime/http_server.py's port: a server that may give way (the local launcher's status page)
takes a free port when its own is another process's, decided when it binds; one that may not (a deployed
service, whose probes and scrapes look for its port) fails with EADDRINUSE. The controller's service
spec asks for the first only where the launcher says so."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from flywheel.runtime.http_server import HttpServer
from services.controller.app import service_spec
from services.controller.config import ControllerConfig
from services.controller.ops.runs import RunManager


def _never_connect(cfg):
    raise AssertionError("no run is started here")


def _app() -> FastAPI:
    app = FastAPI()
    app.get("/")(lambda: {"ok": True})
    return app


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process holds: bound and listening, as a second run's status page would be."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        yield other.getsockname()[1]


async def test_a_taken_port_gives_way_to_a_free_one_that_serves(taken: int) -> None:
    server = HttpServer(_app(), "127.0.0.1", taken, free_port_if_taken=True)
    port = await server.start()
    try:
        assert port not in (0, taken) and server.port == port
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).json() == {"ok": True}
    finally:
        await server.stop()


async def test_a_server_that_may_not_give_way_fails_on_a_taken_port(taken: int) -> None:
    with pytest.raises(OSError) as failed:
        await HttpServer(_app(), "127.0.0.1", taken).start()
    assert failed.value.errno == errno.EADDRINUSE


async def test_a_free_port_is_kept(taken: int) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = HttpServer(_app(), "127.0.0.1", free, free_port_if_taken=True)
    try:
        assert await server.start() == free
    finally:
        await server.stop()


@pytest.mark.parametrize("gives_way", [True, False])
async def test_the_controllers_status_page_gives_way_only_when_asked(tmp_path: Path, taken: int,
                                                                      gives_way: bool) -> None:
    config = ControllerConfig.model_validate({"status_port": taken, "runs_dir": str(tmp_path)})
    told: list[int] = []
    spec = service_spec(config, RunManager(tmp_path, _never_connect), on_status_page=told.append,
                        free_status_port_if_taken=gives_way)
    if not gives_way:
        with pytest.raises(OSError):
            await spec.startup()
        return
    await spec.startup()
    try:
        assert told and told[0] != taken
    finally:
        await spec.shutdown()
