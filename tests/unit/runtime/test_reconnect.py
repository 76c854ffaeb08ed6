"""A channel to a peer that is down keeps trying to connect about once a second,
so a restarted synchronizer (or any service) is reached within a second or two
however long it was away. gRPC's default backoff grows to 120 s, and the channel
fails every call without trying until its timer fires."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc

from flywheel.runtime.client import open_channel

DOWN_SECONDS = 6.0
# The longest wait between connection attempts we accept. gRPC's defaults wait 1, 1.6
# and 2.56 s (each +-20 %) within the first six seconds, so they fail this.
MOST_SECONDS_WITHOUT_A_TRY = 1.6


async def test_a_down_peer_is_tried_about_once_a_second_however_long_it_is_down() -> None:
    # A "peer" that accepts TCP connections and closes them at once: every attempt is a
    # connection failure to gRPC, and the accept times are the attempts.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    attempts: list[float] = []

    async def refuse() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            attempts.append(time.monotonic())
            conn.close()

    refusing = asyncio.ensure_future(refuse())
    channel = open_channel(f"127.0.0.1:{listener.getsockname()[1]}", default_timeout=0.5)
    status = channel.unary_unary("/flywheel.Probe/Status")
    start = time.monotonic()
    try:
        while time.monotonic() - start < DOWN_SECONDS:  # a component heartbeating a down synchronizer
            try:
                await status(b"")
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        end = time.monotonic()
    finally:
        refusing.cancel()
        await channel.close()
        listener.close()
    assert attempts, "the channel never tried to connect"
    gaps = [b - a for a, b in zip([start, *attempts], [*attempts, end])]
    assert max(gaps) < MOST_SECONDS_WITHOUT_A_TRY, f"attempts {[round(t - start, 2) for t in attempts]}"
