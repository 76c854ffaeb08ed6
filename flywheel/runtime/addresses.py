"""A "host:port" that a peer will dial, checked where it is given: a malformed one is refused up
front (INVALID_ARGUMENT naming the field) instead of surfacing later as UNAVAILABLE when somebody
dials it."""

from __future__ import annotations

import ipaddress
import re

from flywheel.errors import InvalidArgument

#: The names of this machine's loopback interface.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# A DNS name (labels of letters, digits, hyphens, underscores as Kubernetes/compose names allow).
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


def check_address(value: str, field: str) -> str:
    """`value` if it is host:port (a DNS name, an IPv4 address or a bracketed IPv6 one, and a port
    in 1-65535); InvalidArgument naming `field` otherwise."""
    host, sep, port = value.rpartition(":")
    why = ""
    if not sep or not host:
        why = "expected host:port"
    elif not port.isdigit() or not 1 <= int(port) <= 65535:
        why = f"port {port!r} is not in 1-65535"
    elif host.startswith("["):
        if not host.endswith("]") or not _is_ip(host[1:-1], 6):
            why = f"{host!r} is not a bracketed IPv6 address"
    elif ":" in host:
        why = "an IPv6 address needs brackets: [addr]:port"
    elif not (_is_ip(host, 4) or _HOSTNAME.match(host)):
        why = f"{host!r} is not a host name or an IPv4 address"
    if why:
        raise InvalidArgument(f"{field}: {value!r}: {why}")
    return value


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False
