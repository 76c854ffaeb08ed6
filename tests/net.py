"""Network helpers shared by the tests: a free TCP port for a server or a rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 the OS just handed out and that is free again on return; another
    process may take it before the caller binds it, a race the tests accept."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
