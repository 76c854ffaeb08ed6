"""Network helpers shared by the tests and benches: a free TCP port for a server or a rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free just now, for a server a test or bench starts (free_port_range:
    below the ports the OS hands out itself). Another process may still take it before the caller binds
    it, but only one that picks ports the same way. An ephemeral port the OS hands out (bind to 0) is
    free again on return, and any process's next outgoing connection or port-0 server may take it
    meanwhile: a test's synchronizer once found its metrics port taken that way, beside the other
    test worker's services."""
    return free_port_range(1)[0]


def free_port_range(count: int, low: int = 20000, high: int = 29000, attempts: int = 500) -> range:
    """`count` consecutive ports on 127.0.0.1 that were all free just now (another process drawing
    from the same range may take one before the caller binds it). Drawn from [low, high): below the
    OS's ephemeral ports, which it hands to any process's outgoing connections and port-0 servers,
    and below the synchronizer's default rendezvous ports (29600-29999), which other synchronizers on
    the machine use."""
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
