"""gRPC channel arguments that servers and clients must agree on.

Keepalive pings from clients are only accepted if the server allows that
ping rate, and a message is only accepted if both sides' size limits admit
it, so both sides take their options from here.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# gRPC's own reconnect backoff grows to 120 s while a peer is down, and a channel
# fails every call without trying until its timer fires; subchannels are shared by
# every channel of a process to the same address, so even a new client waited. A
# synchronizer back after a 40 s outage stayed unreachable for 31 s with the
# defaults. A connect attempt every second to a down peer costs nothing.
RECONNECT_INITIAL_BACKOFF_MS = 250
RECONNECT_MAX_BACKOFF_MS = 1_000


def _shared_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """What both sides set alike: message size limits and keepalive pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        *_shared_options(max_message_bytes),
        # Accept client pings as often as clients send them (plus slack).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def client_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        *_shared_options(max_message_bytes),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_BACKOFF_MS),
    ]
