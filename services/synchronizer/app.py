"""Assembles the synchronizer service for the server bootstrap.

Handlers are registered from the service descriptor rather than the
generated `add_..._to_server`, so that PushWeights and PullWeights can take
and give raw frames (identity serializers; see `flywheel.transfer.frames`)
while every other RPC uses the generated message classes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

import grpc
from google.protobuf import message_factory

import services.synchronizer.metrics  # noqa: F401  (registers the service's metric families)
from flywheel.codec.malloc import tune_allocator
from flywheel.runtime.auth import Scope, own_token
from flywheel.runtime.server import ServiceSpec
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.presence import Presence, advertised_address, reachable_host
from flywheel.synchronizer.types import Role
from flywheel.synchronizer.v1 import synchronizer_pb2
from services.synchronizer.config import SynchronizerConfig
from services.synchronizer.core import Synchronizer
from services.synchronizer.plane import WeightPlane
from services.synchronizer.relay import Relay
from services.synchronizer.servicer import SynchronizerServicer

log = logging.getLogger(__name__)

SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["SynchronizerService"]
PROTO_SERVICE = SERVICE.full_name
#: Every method is for the trainer, the rollouts and the controller to call on the synchronizer.
METHOD_SCOPES = {method.name: Scope.SERVICE for method in SERVICE.methods}
#: Methods whose request (push) or response (pull) stays raw bytes.
RAW_REQUEST = {"PushWeights"}
RAW_RESPONSE = {"PullWeights"}
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>


def method_handlers(servicer: SynchronizerServicer) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        kw = dict(
            request_deserializer=None if method.name in RAW_REQUEST else request_cls.FromString,
            response_serializer=None if method.name in RAW_RESPONSE else response_cls.SerializeToString,
        )
        behaviour = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **kw)
        elif method.client_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(behaviour, **kw)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(behaviour, **kw)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behaviour, **kw)
    return handlers


def register(server: grpc.aio.Server, servicer: SynchronizerServicer) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PROTO_SERVICE, method_handlers(servicer)),))


def retain_freed_memory() -> bool:
    """Stops glibc from returning freed heap memory to the kernel.

    Versions arrive as ~1 MiB frames and leave a whole version at a time (on
    eviction). With trimming, the freed top of the heap goes back to the
    kernel and the next version page-faults fresh zeroed memory in: measured,
    that doubled the server's CPU per pushed byte. Without it the process
    keeps its high-water mark, which is the bound it is sized for anyway
    (keep_versions + max_concurrent_pushes versions). No-op off glibc.
    """
    tune_allocator()  # mmap threshold above a frame, so frames come from the heap
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1  # -1: never trim
    except (OSError, AttributeError):
        return False


def build(config: SynchronizerConfig) -> ServiceSpec:
    retain_freed_memory()
    sync = Synchronizer(config)
    plane = WeightPlane(sync)
    servicer = SynchronizerServicer(sync, plane)
    if not sync.store.enabled:
        log.warning("no store_path: component states and version metadata are not persisted")

    async def sweep_loop() -> None:
        # Leases, DYNAMIC request timeouts and transfer deadlines all run off this tick.
        while True:
            try:
                sync.sweep()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad tick
                log.exception("sweep failed")
            await asyncio.sleep(config.sweep_interval_seconds)

    relay_presence: list[Presence] = []
    grpc_port = [0]
    if config.relay is not None:
        link = config.relay
        plane.relay = Relay(link.upstream, lambda: SynchronizerClient(
            link.upstream, own_token(config.server), timeout=link.rpc_timeout_seconds,
            transfer_timeout=config.transfer_timeout_seconds, max_message_bytes=config.server.max_message_bytes,
            shared_memory=False), sync.weights, config.transfer_timeout_seconds)

    async def startup() -> None:
        if config.relay is None or plane.relay is None:
            return
        link = config.relay
        address = advertised_address(link, config.server.host, grpc_port[0])
        component_id = link.component_id or f"relay-{link.site}-{reachable_host(config.server.host)}-{grpc_port[0]}"
        presence = Presence(plane.relay.client, Role.SYNCHRONIZER, component_id, address, link,
                            progress=lambda: (0, sync.weights.newest), labels={"site": link.site})
        presence.start()
        relay_presence.append(presence)
        log.info("relay mode", extra={"upstream": link.upstream, "site": link.site, "address": address})

    async def shutdown() -> None:
        for presence in relay_presence:
            await presence.stop()
        if plane.relay is not None:
            await plane.relay.close()
        sync.store.close()
        sync.weights.close()

    return ServiceSpec(
        name="synchronizer",
        proto_services=[PROTO_SERVICE],
        register=lambda server: register(server, servicer),
        method_scopes=METHOD_SCOPES,
        on_bound=lambda port: grpc_port.__setitem__(0, port),
        startup=startup,
        shutdown=shutdown,
        draining=sync.events.close,
        background=[sweep_loop],
    )
