"""Network helpers shared by the tests: a free TCP port for a server or a rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 the OS just handed out and that is free again on return; another
    process may take it before the caller binds it, a race the tests accept."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int, low: int = 20000, high: int = 29000, attempts: int = 500) -> range:
    """`count` consecutive ports on 127.0.0.1 that were all free just now (the race of `free_port`
    applies to each). Drawn from [low, high): below the OS's ephemeral ports, which it hands to
    any process's outgoing connections, and below the synchronizer's default rendezvous ports
    (29600-29999), which other synchronizers on the machine use."""
    import random

    for _ in range(attempts):
        start = random.randrange(low, high - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(start, start + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return range(start, start + count)
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high})")
