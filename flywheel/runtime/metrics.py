"""Prometheus metrics every service exports, and the /metrics HTTP endpoint.

Names follow Prometheus conventions: `flywheel_` prefix, base units
(`_seconds`, `_bytes`), counters end in `_total`, and no per-request labels.
Each process runs one service, so the default registry is the service's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from flywheel.runtime.auth import Scope, TokenScopes, refusal
from flywheel.runtime.tls import TlsFiles, server_ssl_context

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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes are not news
        pass


def _requiring_token(app: Callable, tokens: TokenScopes) -> Callable:
    """A WSGI app that answers 401 unless the request carries one of `tokens` (any scope but a
    Tinker tenant's key, which opens nothing but the Tinker API: 403)."""

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        held = tokens.scope_of(environ.get("HTTP_AUTHORIZATION"))
        if held is None:
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong bearer token\n"]
        if held < Scope.VIEWER:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [f"{refusal('/metrics', Scope.VIEWER, held)}\n".encode()]
        return app(environ, start_response)

    return guarded


def serve_metrics(
    host: str, port: int, *, tls: TlsFiles | None = None, tokens: TokenScopes | None = None
) -> tuple[int, object]:
    """Starts /metrics in a daemon thread, over TLS when `tls` serves it, needing one of `tokens`
    when given; returns (bound port, server to shut down)."""
    app = make_wsgi_app(REGISTRY)
    if tokens:
        app = _requiring_token(app, tokens)
    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    context = server_ssl_context(tls) if tls is not None else None
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    # serve_forever's poll interval is how long `shutdown()` waits at most: its default (0.5 s) was
    # half of a service's whole stop.
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True, name="metrics").start()
    return server.server_port, server
