"""The gRPC server bootstrap every service runs.

`serve(spec, config)`:
1. builds a `grpc.aio` server with the error and auth interceptors, the
   standard `grpc.health.v1` service (NOT_SERVING to begin with) and reflection;
2. binds the port (TLS only, when the config has a certificate: the process's
   clients and HTTP listeners then use the same TLS) and starts /metrics;
3. runs the service's `startup` (load a model, open a store...), and only then
   reports SERVING and writes the ready file;
4. on SIGTERM or SIGINT reports NOT_SERVING, stops with a grace period for
   in-flight calls, then runs the service's `shutdown`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flywheel.runtime.auth import Scope, accepted_tokens
from flywheel.runtime.channel_options import server_options
from flywheel.runtime.interceptors import AuthInterceptor, ErrorInterceptor
from flywheel.runtime.metrics import BUILD_INFO, SERVICE_READY, serve_metrics
from flywheel.runtime.config import ConfigError
from flywheel.runtime.server_config import ServerConfig
from flywheel.runtime.tls import adopt as adopt_tls, describe as describe_tls, resolve as resolve_tls, server_credentials

log = logging.getLogger(__name__)

FLYWHEEL_VERSION = "0.1.0"


@dataclass
class ServiceSpec:
    """What a service plugs into the bootstrap."""

    #: Short name for logs and metric labels, e.g. "trainer".
    name: str
    #: Fully qualified proto service names, e.g. "flywheel.trainer.v1.TrainerService".
    proto_services: Sequence[str]
    #: Adds the servicers to the server.
    register: Callable[[grpc.aio.Server], None]
    #: Told the bound gRPC port (a free one when the config says 0) before
    #: startup runs, for a service that tells others where to reach it.
    on_bound: Callable[[int], None] | None = None
    #: Runs before SERVING is reported (model loading...).
    startup: Callable[[], Awaitable[None]] | None = None
    #: Runs after the server stopped.
    shutdown: Callable[[], Awaitable[None]] | None = None
    #: Called as the server starts to stop, before its grace period: ends the streams that never end by
    #: themselves (the synchronizer's Watch), which would otherwise hold the whole grace period open.
    draining: Callable[[], None] | None = None
    #: Extra coroutines run while serving (background loops); cancelled on stop.
    background: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    #: The least token scope each method of `proto_services` may be called with, by method
    #: name ("Generate"); methods not named need Scope.OPERATOR (flywheel.runtime.auth).
    method_scopes: Mapping[str, Scope] = field(default_factory=dict)


@dataclass
class RunningServer:
    grpc_port: int
    metrics_port: int


def full_method_scopes(spec: ServiceSpec) -> dict[str, Scope]:
    """`spec.method_scopes` by full method name; a name no proto service of the spec has is an
    error here, at start, rather than a method silently left to operators."""
    from google.protobuf import descriptor_pool

    services = [descriptor_pool.Default().FindServiceByName(name) for name in spec.proto_services]
    scopes: dict[str, Scope] = {}
    for method, scope in spec.method_scopes.items():
        owners = [s for s in services if method in s.methods_by_name]
        if not owners:
            raise ValueError(f"{spec.name}: method_scopes names {method!r}, which none of {list(spec.proto_services)} has")
        for service in owners:
            scopes[f"/{service.full_name}/{method}"] = scope
    return scopes


def _write_ready_file(path: Path, info: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # readers never see a half-written file


async def serve(
    spec: ServiceSpec,
    config: ServerConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[RunningServer], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Runs the service until SIGTERM/SIGINT (or `stop` is set). With
    `handle_signals=False` the caller owns the signals and sets `stop` itself
    (the controller's launcher: its first Ctrl-C checkpoints before stopping)."""
    tokens = accepted_tokens(config)
    if config.metrics_auth and not tokens:
        raise ConfigError("server.metrics_auth: /metrics cannot need a token when no token is configured")
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(spec.name)]
    if tokens:
        interceptors.append(AuthInterceptor(tokens, full_method_scopes(spec)))
        log.info("auth on", extra={"tokens": repr(tokens)})
    else:
        log.warning("no auth token configured: every client is accepted")

    server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    spec.register(server)
    reflection.enable_server_reflection(
        [*spec.proto_services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    for name in ("", *spec.proto_services):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    tls = resolve_tls(config.tls)
    adopt_tls(tls)  # this process's clients and HTTP listeners use it too
    credentials = server_credentials(tls)
    address = f"{config.host}:{config.port}"
    grpc_port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if grpc_port == 0:
        raise OSError(f"cannot bind gRPC port {config.host}:{config.port}")
    await server.start()
    if spec.on_bound is not None:
        spec.on_bound(grpc_port)
    metrics_port, metrics_server = serve_metrics(
        config.metrics_host or config.host, config.metrics_port, tls=tls, tokens=tokens if config.metrics_auth else None
    )
    BUILD_INFO.labels(spec.name, FLYWHEEL_VERSION).set(1)
    log.info("listening", extra={"grpc_port": grpc_port, "metrics_port": metrics_port, "host": config.host,
                                 "tls": describe_tls(tls) or "off"})

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if handle_signals else ():
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    background: list[asyncio.Task] = []
    try:
        if spec.startup is not None:
            startup = asyncio.ensure_future(spec.startup())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({startup, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not startup.done():
                startup.cancel()
                log.info("stopped during startup")
                return
            startup.result()  # re-raises a failed startup
        for name in ("", *spec.proto_services):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        SERVICE_READY.labels(spec.name).set(1)
        background = [asyncio.ensure_future(make()) for make in spec.background]
        running = RunningServer(grpc_port=grpc_port, metrics_port=metrics_port)
        if config.ready_file is not None:
            _write_ready_file(
                config.ready_file,
                {"service": spec.name, "pid": os.getpid(), "grpc_port": grpc_port, "metrics_port": metrics_port},
            )
        if on_ready is not None:
            on_ready(running)
        log.info("serving")
        await stop.wait()
    finally:
        log.info("shutting down", extra={"grace_seconds": config.shutdown_grace_seconds})
        SERVICE_READY.labels(spec.name).set(0)
        # Health watchers see NOT_SERVING before the listener closes.
        await health_servicer.enter_graceful_shutdown()
        for task in background:
            task.cancel()
        if spec.draining is not None:
            spec.draining()
        await server.stop(config.shutdown_grace_seconds)
        if spec.shutdown is not None:
            await spec.shutdown()
        metrics_server.shutdown()
        metrics_server.server_close()
        log.info("stopped")
