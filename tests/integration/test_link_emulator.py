"""The emulated link (flywheel/testing/link_emulator.py) is the link it says: its rate, its delay, its loss and its cuts,
seen by real kernel TCP between two network namespaces."""

from __future__ import annotations

import sys
import time

import pytest

from flywheel.testing.link_emulator import EmulatedLink, available

WHY_NOT = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")]

# A receiver in `far` that reads N bytes and answers their sum mod 2**32 (so a byte changed on the way shows);
# a sender in `near` that connects (timing the handshake: one round trip), sends N bytes and prints both times.
PEER = r"""
import socket, sys, time
role, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "far":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 5301)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); got = 0; total = 0
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b); total = (total + sum(b)) % 2**32
    c.sendall(f"{got} {total}\n".encode())
else:
    t = time.monotonic(); c = socket.create_connection((host, 5301), timeout=60); handshake = time.monotonic() - t
    block = bytes(range(256)) * 4096
    t = time.monotonic(); sent = 0
    while sent < n:
        part = block[: min(len(block), n - sent)]; c.sendall(part); sent += len(part)
    answer = c.makefile().readline().split()
    print(handshake, time.monotonic() - t, answer[0], answer[1], flush=True)
"""


def _transfer(link: EmulatedLink, n: int, during=None) -> tuple[float, float, int, int]:
    far = link.popen("far", [sys.executable, "-c", PEER, "far", link.far_address, str(n)], stdout=-1, text=True)
    assert far.stdout.readline().strip() == "listening"
    near = link.popen("near", [sys.executable, "-c", PEER, "near", link.far_address, str(n)], stdout=-1, text=True)
    if during:
        during()
    out, _ = near.communicate(timeout=120)
    handshake, seconds, got, checksum = out.split()
    return float(handshake), float(seconds), int(got), int(checksum)


def _expected_checksum(n: int) -> int:
    block = bytes(range(256)) * 4096
    whole, rest = divmod(n, len(block))
    return (whole * sum(block) + sum(block[:rest])) % 2**32


def test_the_link_has_its_rate_and_its_delay():
    n = 2_000_000
    with EmulatedLink(rate_bits=20e6, delay=0.05) as link:
        handshake, seconds, got, checksum = _transfer(link, n)
    assert (got, checksum) == (n, _expected_checksum(n))
    assert 0.1 <= handshake < 0.3  # one round trip: 2 x 50 ms
    wire = n * 8 / 20e6  # 0.8 s of payload at 20 Mbit/s, headers and slow start on top
    assert wire < seconds < 4 * wire, seconds


def test_lost_packets_are_retransmitted_by_tcp_and_a_cut_stalls_the_stream():
    n = 2_000_000
    with EmulatedLink(rate_bits=50e6, delay=0.01, loss=0.02, seed=1) as link:
        _, lossy, got, checksum = _transfer(link, n)
        stats = link.stats()["near->far"]
        assert (got, checksum) == (n, _expected_checksum(n))  # every byte, in order, despite the loss
        assert stats.lost > 0 and stats.forwarded_packets > n // 1500

        before = link.stats()["near->far"].forwarded_bytes

        def cut_soon():
            # Once the payload flows (200 kB of the 2 MB through), not at a fixed time: a sender slow to
            # start would meet the cut in its handshake, which TCP waits out before the timed part.
            deadline = time.monotonic() + 60
            while link.stats()["near->far"].forwarded_bytes - before < 200_000 and time.monotonic() < deadline:
                time.sleep(0.005)
            link.cut(1.5)

        _, cut, got, checksum = _transfer(link, n, during=cut_soon)
        assert (got, checksum) == (n, _expected_checksum(n))
        assert link.stats()["near->far"].cut_drops > 0
        assert cut > 1.5, cut  # dark for 1.5 s: the transfer waited it out
