"""Loopback only, for every Python process started with this directory on its PYTHONPATH (Python
imports `sitecustomize` at start-up) and FLYWHEEL_LOOPBACK_LOG set: tests/integration/test_tinker_cookbook.py
runs the Tinker cookbook's recipes and the services so.

An audit hook refuses any other destination, by name (getaddrinfo, gethostbyname) or by address
(connect, sendto, sendmsg), as an unreachable network would, and appends what it refused to
FLYWHEEL_LOOPBACK_LOG as one JSON line (pid, program, event, host, port). Sockets opened by C code that
bypasses Python's socket module (gRPC's core) are not seen: a network namespace with nothing but
loopback, where the test can make one, covers those.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import sys

_LOG = os.environ.get("FLYWHEEL_LOOPBACK_LOG")
_WHY = "only loopback may be contacted (tests/integration/loopback_only)"


def _is_loopback(host: object) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    name = str(host).strip("[]").split("%")[0]  # an IPv6 literal may come bracketed or with a scope
    if name in ("", "localhost") or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # any other name: resolving it is contacting a DNS server
    return address.is_loopback or address.is_unspecified


def _refuse(event: str, host: object, port: object, error: OSError) -> None:
    record = {"pid": os.getpid(), "program": " ".join(sys.argv[:1]), "event": event, "host": str(host),
              "port": port if isinstance(port, int) else str(port)}
    with open(_LOG, "a") as log:  # one short append per line: whole lines even from several processes
        log.write(json.dumps(record) + "\n")
    raise error


def _hook(event: str, args: tuple) -> None:
    if not event.startswith("socket."):
        return
    if event == "socket.getaddrinfo":
        host, port = args[0], args[1]
        if not _is_loopback(host):
            _refuse(event, host, port, socket.gaierror(socket.EAI_NONAME, f"{host}: {_WHY}"))
    elif event in ("socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr"):
        if not _is_loopback(args[0]):
            _refuse(event, args[0], None, socket.gaierror(socket.EAI_NONAME, f"{args[0]}: {_WHY}"))
    elif event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) \
                and not _is_loopback(address[0]):
            _refuse(event, address[0], address[1], OSError(errno.ENETUNREACH, f"{address[0]}: {_WHY}"))


if _LOG:
    sys.addaudithook(_hook)
