"""A real synchronizer server inside the current event loop (tests, tools,
single-process demos): the same gRPC server, servicer and background loop as
`python -m services.synchronizer`, on a free port.

    async with embedded_synchronizer(lease_seconds=2) as server:
        async with SynchronizerClient(server.address) as client:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from flywheel.runtime.server import RunningServer, serve
from flywheel.runtime.server_config import ServerConfig
from services.synchronizer.app import build
from services.synchronizer.config import SynchronizerConfig


@dataclass
class EmbeddedSynchronizer:
    address: str
    metrics_url: str
    config: SynchronizerConfig


@contextlib.asynccontextmanager
async def embedded_synchronizer(
    server: dict[str, Any] | None = None, **fields: Any
) -> AsyncIterator[EmbeddedSynchronizer]:
    """Serves a synchronizer configured by `fields` (SynchronizerConfig fields;
    `server` overrides ServerConfig fields) until the block exits."""
    server_config = ServerConfig(**{"port": 0, "metrics_port": 0, "shutdown_grace_seconds": 0.5, **(server or {})})
    config = SynchronizerConfig(server=server_config, **fields)
    stop = asyncio.Event()
    ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(build(config), config.server, stop=stop, on_ready=ready.set_result))
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # startup failed: re-raise
    running = ready.result()
    try:
        yield EmbeddedSynchronizer(
            address=f"127.0.0.1:{running.grpc_port}",
            metrics_url=f"http://127.0.0.1:{running.metrics_port}/metrics",
            config=config,
        )
    finally:
        stop.set()
        await task
