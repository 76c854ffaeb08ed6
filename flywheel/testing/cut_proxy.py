"""A TCP forwarder that can break its connections on cue, for tests and
benches of transfers that must survive a dropped connection (a NAT that
forgets a flow, a restarted load balancer, a peer that resets).

`CutProxy` listens (on loopback by default) and forwards every connection to `target`,
counting the bytes it passes each way. `cut_after(n)` arms a one-shot cut:
once `n` more bytes went from the target to the client, every connection
open at that moment is reset (both sides see the connection die at once, as
with a TCP RST); connections made afterwards pass normally. The link
emulator (`flywheel.testing.link_emulator`) models a slow or lossy path;
this models the path going away.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class CutProxy:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.port = listen_port
        #: Bytes forwarded target -> client and client -> target, over every connection.
        self.downstream_bytes = 0
        self.upstream_bytes = 0
        self.cuts = 0
        self._cut_at: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._serve, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._reset_all()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    def cut_after(self, nbytes: int) -> None:
        """Reset every open connection once `nbytes` more bytes have gone to clients."""
        self._cut_at = self.downstream_bytes + nbytes

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, target_writer}
        try:
            await asyncio.gather(self._pipe(client_reader, target_writer, downstream=False),
                                 self._pipe(target_reader, client_writer, downstream=True))
        finally:
            for writer in (client_writer, target_writer):
                self._writers.discard(writer)
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, downstream: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if downstream and self._cut_at is not None and self.downstream_bytes + len(data) >= self._cut_at:
                    data = data[: max(0, self._cut_at - self.downstream_bytes)]
                    writer.write(data)
                    self.downstream_bytes += len(data)
                    self._cut_at = None
                    self.cuts += 1
                    self._reset_all()
                    return
                writer.write(data)
                await writer.drain()
                if downstream:
                    self.downstream_bytes += len(data)
                else:
                    self.upstream_bytes += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            sock = writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close sends RST, not FIN (a broken path, not a clean end)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._writers.clear()
