"""Prometheus metrics every service exports, and the /metrics HTTP endpoint.

Names follow Prometheus conventions: `flywheel_` prefix, base units
(`_seconds`, `_bytes`), counters end in `_total`, and no per-request labels.
Each process runs one service, so the default registry is the service's.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

RPC_REQUESTS = Counter(
    "flywheel_rpc_requests_total",
    "gRPC requests handled, by method and status code.",
    ["service", "method", "code"],
)
RPC_DURATION = Histogram(
    "flywheel_rpc_duration_seconds",
    "Time spent handling a gRPC request, in seconds.",
    ["service", "method"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 120),
)
SERVICE_READY = Gauge(
    "flywheel_service_ready",
    "1 while the service reports SERVING on gRPC health, else 0.",
    ["service"],
)
BUILD_INFO = Gauge(
    "flywheel_build_info",
    "Constant 1, labelled with the Flywheel version and the service.",
    ["service", "version"],
)


def serve_metrics(host: str, port: int) -> tuple[int, object]:
    """Starts /metrics in a daemon thread; returns (bound port, server to shut down)."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_port, server
