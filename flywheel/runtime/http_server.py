"""Runs an HTTP app (the rollout's OpenAI API, the controller's status page) with
uvicorn on the gRPC server's event loop.

It serves TLS only when the process has a certificate (flywheel.runtime.tls),
and then requires client certificates under mutual TLS.

The socket is bound before uvicorn starts, so port 0 resolves to a real port
that the service can report. uvicorn's own signal handling is disabled: the
runtime owns SIGTERM and stops this server from the service's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from flywheel.runtime.tls import TlsFiles, process_tls

log = logging.getLogger(__name__)


def http_ready_file(ready_file: Path) -> Path:
    """Where a service reports its HTTP port, next to the runtime's ready file (for launchers)."""
    return ready_file.with_name(f"{ready_file.stem}.http.json")


def report_http_port(ready_file: Path | None, port: int) -> None:
    """Writes {"http_port": N} to `http_ready_file(ready_file)` atomically; nothing without a ready file."""
    if ready_file is None:
        return
    target = http_ready_file(ready_file)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"http_port": port}))
    os.replace(tmp, target)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, name: str = "http", tls: TlsFiles | None = None,
                 free_port_if_taken: bool = False) -> None:
        """`tls`: default this process's when started (flywheel.runtime.tls; the bootstrap adopts the
        service's before startup runs): TLS only when it has a certificate. `free_port_if_taken`: when
        `port` is another process's, listen on a free one (`start` returns it) instead of failing."""
        self._tls = tls
        self._app = app
        self._name = name
        self._host = host
        self._port = port
        self._free_port_if_taken = free_port_if_taken
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    def _bound(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit it (Linux): without it a response written in two parts (headers,
            # then body) waits for the client's delayed ACK, 40 ms per request on a kept-alive connection.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self._host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def start(self) -> int:
        try:
            sock = self._bound(self._port)
        except OSError as exc:
            # Decided when binding, not by a check before it: another process may take the port in between.
            if not (self._free_port_if_taken and self._port and exc.errno == errno.EADDRINUSE):
                raise
            log.info("%s: port %d is taken; listening on a free one", self._name, self._port)
            sock = self._bound(0)
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        tls = self._tls if self._tls is not None else process_tls()
        config = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30, log_config=None,
            ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file, ssl_ca_certs=tls.client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca_file else ssl.CERT_NONE,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=self._name)
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raises why it could not start
            await asyncio.sleep(0.01)
        log.info("%s listening", self._name, extra={"http_port": self.port, "host": self._host})
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
