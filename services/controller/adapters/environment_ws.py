"""An OpenEnv environment server's session over its WebSocket path (`/ws`), as the environment
worker (services/controller/workers/environment.py) uses it: the protocol's JSON messages
({"type": "reset" | "step" | "close", "data": ...}), answered {"type": "observation", "data":
{"observation": {...}, "reward": r, "done": d, "metadata": {...}}} or {"type": "error", "data":
{"message", "code"}}. Nothing of the openenv package is imported: an environment is a service of
its own, in its own process and environment (openenv 0.10 and vLLM 0.32 ask for different mcp).

Every call has a deadline (`timeout_seconds`), the connection one of its own; a session that
cannot be opened, or a call that gets no answer in time, raises `EnvironmentUnavailable` (the
episode is retried); an error answer raises `EnvironmentRefused` with the environment's message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import websockets

from services.controller.run_config import EnvironmentConfig
from services.controller.workers.environment import EnvironmentRefused, EnvironmentUnavailable

#: Largest message accepted from an environment (an observation with an image, say).
MAX_MESSAGE_BYTES = 16 * 2**20


def sessions_url(url: str) -> str:
    """The /ws path of the server at `url` (http(s) or ws(s))."""
    root = url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if root.startswith(http):
            root = ws + root[len(http):]
    return root if root.endswith("/ws") else root + "/ws"


class WebSocketSession:
    def __init__(self, connection: Any, timeout: float, url: str) -> None:
        self.connection, self.timeout, self.url = connection, timeout, url

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        return await self._call("reset", kwargs)

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return await self._call("step", action)

    async def _call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        try:
            await asyncio.wait_for(self.connection.send(json.dumps({"type": kind, "data": data})), self.timeout)
            raw = await asyncio.wait_for(self.connection.recv(), self.timeout)
        except TimeoutError:
            raise EnvironmentUnavailable(f"environment {self.url}: no answer to {kind} within {self.timeout:g} s "
                                         "(worker.env.timeout_seconds)") from None
        except (OSError, websockets.ConnectionClosed) as exc:
            raise EnvironmentUnavailable(f"environment {self.url}: {kind}: {exc}") from None
        try:
            message = json.loads(raw)
        except ValueError:
            raise EnvironmentRefused(f"environment {self.url}: {kind} answered with no JSON: {str(raw)[:200]!r}") from None
        if message.get("type") == "error":
            error = message.get("data") or {}
            raise EnvironmentRefused(f"environment {self.url}: {kind} refused ({error.get('code', '?')}): "
                                     f"{error.get('message', error)}")
        if message.get("type") != "observation" or not isinstance(message.get("data"), dict):
            raise EnvironmentRefused(f"environment {self.url}: {kind} answered {str(message)[:200]!r}, not an observation")
        return message["data"]


def websocket_sessions(config: EnvironmentConfig):
    """Opens sessions on the environment server of `config` (an `OpenSession`)."""
    url = sessions_url(config.url)

    @asynccontextmanager
    async def open_session() -> AsyncIterator[WebSocketSession]:
        try:
            connection = await websockets.connect(url, open_timeout=config.connect_timeout_seconds,
                                                  max_size=MAX_MESSAGE_BYTES, close_timeout=1.0)
        except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
            raise EnvironmentUnavailable(f"environment {url}: no session: {exc}") from None
        try:
            yield WebSocketSession(connection, config.timeout_seconds, url)
        finally:
            try:
                await asyncio.wait_for(connection.send(json.dumps({"type": "close", "data": {}})), 1.0)
            except Exception:  # noqa: BLE001 - closing a session the server already dropped
                pass
            await connection.close()

    return open_session
