"""A service as a component of the synchronizer: registration, heartbeats,
deregistration. Used by the trainer and (with weight-update reports on top)
the rollout.

Once its model is loaded, a service registers (its role, id, the address its
gRPC server is reached at, the transfer methods it supports, its step and
weight version) and then heartbeats at least every lease/3 with its current
step and version; a synchronizer that forgot it (restarted without a store)
or expired its lease gets it registered again (`flywheel.synchronizer.heartbeats`).
A synchronizer that cannot be reached is retried with backoff while the
service keeps serving: nothing here ever raises into the service.

On graceful shutdown the service deregisters, so nobody waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Mapping

from flywheel.errors import FlywheelError
from flywheel.runtime.backoff import Backoff
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.heartbeats import Heartbeats
from flywheel.synchronizer.presence_config import PresenceConfig
from flywheel.synchronizer.types import Method, Role

log = logging.getLogger(__name__)

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}

#: The deadline of the deregistration on a graceful stop. A synchronizer that answers does so in
#: milliseconds; one that is gone (a cluster stops every pod at once) would otherwise hold the
#: stop for the retry policy's 3 s, and its lease ends the registration anyway.
DEREGISTER_TIMEOUT_SECONDS = 1.0


def reachable_host(host: str) -> str:
    """A host others can connect to: a wildcard is where we listen, not an address."""
    return socket.gethostname() if host in _WILDCARDS else host


def advertised_address(config: PresenceConfig, host: str, grpc_port: int) -> str:
    """Where others reach this service's gRPC server (bound on `host`:`grpc_port`)."""
    return config.advertise_address or f"{reachable_host(host)}:{grpc_port}"


class Presence:
    def __init__(
        self,
        client: SynchronizerClient,
        role: Role,
        component_id: str,
        address: str,
        config: PresenceConfig,
        progress: Callable[[], tuple[int, int]],
        *,
        capabilities: Iterable[Method] = (),
        labels: Mapping[str, str] | None = None,
        identity: Callable[[], bytes] = lambda: b"",
    ) -> None:
        self.client, self.role, self.config = client, role, config
        self.component_id, self.address = component_id, address
        #: (step, weight version) now; read at registration and at every heartbeat.
        self.progress = progress
        #: The identity of the weights held (flywheel.codec.identity; b"": unknown), told at registration.
        self.identity = identity
        self.capabilities = tuple(capabilities)
        self.labels = dict(labels or {})
        #: Set once the first registration succeeded.
        self.registered = asyncio.Event()
        self.heartbeats: Heartbeats | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._register()))

    async def wait_registered(self, timeout: float) -> bool:
        """Whether the first registration succeeded within `timeout` seconds; retries go on either way.

        A service waits this long before it reports SERVING, so whoever starts
        after it (a controller asking NeedSync under its id) finds it registered.
        """
        try:
            await asyncio.wait_for(self.registered.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Stops beating (and any task a subclass added), then deregisters (within DEREGISTER_TIMEOUT_SECONDS)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.heartbeats is not None:
            await self.heartbeats.stop()
        if self.registered.is_set():
            try:
                await self.client.deregister(self.component_id, timeout=DEREGISTER_TIMEOUT_SECONDS)
                log.info("deregistered from the synchronizer", extra={"id": self.component_id})
            except FlywheelError as exc:
                # Its lease runs out on its own: the synchronizer marks it STOPPED then.
                log.warning("deregistration failed", extra={"id": self.component_id, "error": str(exc)})

    def registered_again(self) -> None:
        """Called after the synchronizer forgot this component (a restart without a store) and it
        registered again: a subclass tells the new synchronizer what only the old one knew."""

    async def _register(self) -> None:
        backoff = Backoff(self.config.retry_initial_seconds, self.config.retry_max_seconds)
        while True:
            step, version = self.progress()
            try:
                registration = await self.client.register(
                    self.role, self.component_id, address=self.address, capabilities=self.capabilities,
                    labels=self.labels, step=step, weight_version=version, weight_identity=self.identity(),
                )
                break
            except FlywheelError as exc:
                # Also for errors a retry cannot fix (a taken id, a wrong token):
                # the service serves on and the log says why it is not registered.
                log.warning("registration with the synchronizer failed; retrying",
                            extra={"id": self.component_id, "address": self.client.address, "error": str(exc),
                                   "retry_seconds": backoff.delay})
                await backoff.wait()
        log.info("registered with the synchronizer",
                 extra={"id": self.component_id, "role": self.role.name.lower(), "address": self.address,
                        "step": step, "weight_version": version, "lease_seconds": registration.lease_seconds})
        self.registered.set()
        interval = self.config.heartbeat_interval_seconds or None
        self.heartbeats = self.client.keep_alive(self.component_id, self.progress, interval=interval,
                                                 identity=self.identity, on_reregistered=self.registered_again)
        self.heartbeats.start()
