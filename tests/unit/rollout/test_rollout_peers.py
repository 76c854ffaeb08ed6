"""Replicas as weight sources for their site (services.rollout.weights.peers): a replica that joins
pulls the version from a peer of its site that holds it verified, not from the synchronizer; a peer
that cannot serve (gone) is passed over for the synchronizer; weights that are not the version the
synchronizer recorded are refused whoever sent them. Real gRPC servers and the transformers engine
on a tiny model, in process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flywheel.codec import DigestMismatch, encode_state_dict
from flywheel.codec.identity import VersionIdentity
from flywheel.errors import InvalidArgument
from flywheel.runtime.server import RunningServer, serve
from flywheel.synchronizer.client import SynchronizerClient
from services.rollout.weights.peers import PEER_LABEL
from services.rollout.weights.sources import memory_stage
from services.synchronizer.embedded import embedded_synchronizer
from tests.integration.test_synchronizer_weights import metric
from flywheel.testing.net import free_port
from tests.unit.rollout.test_rollout_follower import base_state, eventually, link_config, shifted  # noqa: F401

SITE = "site-a"


@contextlib.asynccontextmanager
async def served_rollout(model: Path, synchronizer: str, component_id: str, **updates: object
                         ) -> AsyncIterator[RunningServer]:
    """A whole rollout service (its gRPC server, engine and synchronizer link) at SITE."""
    from services.rollout.app import build

    config = link_config(model, synchronizer, component_id=component_id, site=SITE)
    config.updates = config.updates.model_copy(update=updates)
    stop = asyncio.Event()
    ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(build(config), config.server, stop=stop, on_ready=ready.set_result))
    done, _ = await asyncio.wait({task, ready}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # startup failed: re-raise
    try:
        yield ready.result()
    finally:
        stop.set()
        await task


async def _holds(client: SynchronizerClient, component_id: str, version: int, identity: bytes) -> bool:
    c = (await client.status()).component(component_id)
    return c is not None and c.weight_version == version and c.weight_identity == identity


async def test_a_joining_replica_pulls_from_a_peer_at_its_site_and_passes_over_a_gone_one(
    rollout_model, base_state  # noqa: F811
) -> None:
    v1 = shifted(base_state, 0.01)
    identity = bytes(encode_state_dict(v1, 1).manifest.identity)
    nbytes = sum(t.numel() * t.element_size() for t in v1.values())
    async with embedded_synchronizer(keep_versions=2, lease_seconds=60) as sync, \
            SynchronizerClient(sync.address) as client:
        await client.push_weights(v1, 1)
        # A peer that holds version 1 but is gone (a crashed replica whose lease has not run out).
        await client.register("rollout", "gone-peer", address=f"127.0.0.1:{free_port()}",
                              labels={"site": SITE, PEER_LABEL: "1"}, weight_version=1, weight_identity=identity)
        # Payload bytes the synchronizer served, in its streams or in its shared memory (the process's
        # servers all count into these metrics: read relative).
        pulled = lambda: (metric(sync.metrics_url, "flywheel_weight_pull_bytes_total")  # noqa: E731
                          + metric(sync.metrics_url, "flywheel_weight_pull_shared_bytes_total"))
        served = lambda: metric(sync.metrics_url, "flywheel_rollout_peer_served_bytes_total")  # noqa: E731
        before = pulled()
        async with served_rollout(rollout_model, sync.address, "peer-a", serve_peers=True):
            # It joined with only the gone peer at its site: tried it, then the synchronizer.
            await eventually(lambda: _holds(client, "peer-a", 1, identity), what="peer-a verified on version 1")
            assert pulled() - before >= nbytes
            await client.deregister("gone-peer")

            from_sync, from_peers = pulled(), served()
            async with served_rollout(rollout_model, sync.address, "joiner-b"):
                await eventually(lambda: _holds(client, "joiner-b", 1, identity), what="joiner-b verified")
            assert served() - from_peers == nbytes  # the whole version came from peer-a ...
            assert pulled() == from_sync  # ... and nothing from the synchronizer


async def test_weights_that_are_not_the_recorded_version_are_refused_before_loading(
    rollout_model, base_state  # noqa: F811
) -> None:
    from services.rollout.engine.base import TensorSpec

    v1 = shifted(base_state, 0.01)
    specs = {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in v1.items()}
    async with embedded_synchronizer() as sync, SynchronizerClient(sync.address) as client:
        await client.push_weights(v1, 1)
        recorded_elsewhere = VersionIdentity(b"\x01" * 16)  # what the run's synchronizer says version 1 is
        stage = memory_stage(sync.address, 1, specs, token=None, timeout=30, max_message_bytes=64 << 20,
                             identity=recorded_elsewhere)
        with pytest.raises(DigestMismatch, match="are not version 1"):
            await stage()


async def test_serving_peers_needs_a_site(rollout_model) -> None:
    from services.rollout.app import build

    config = link_config(rollout_model, "127.0.0.1:1", component_id="no-site")
    config.updates = config.updates.model_copy(update={"serve_peers": True})
    with pytest.raises(InvalidArgument, match="serve_peers needs synchronizer.site"):
        await serve(build(config), config.server, stop=asyncio.Event())
