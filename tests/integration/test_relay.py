"""A relay (a synchronizer in relay mode) fetches each version once from upstream and serves a far
site's replicas: cut-through while the version still arrives, later versions as deltas across the
slow side, a joining reader served from what already arrived. Real gRPC servers, in process."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.codec import encode_state_dict
from flywheel.codec.identity import identify
from flywheel.errors import FailedPrecondition
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import DeltaBase
from flywheel.synchronizer.types import Role
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.transfer.frames import encoded_frames
from flywheel.testing.cut_proxy import CutProxy
from services.synchronizer.embedded import embedded_synchronizer
from tests.integration.test_delta_pulls import model, same, step
from tests.integration.test_synchronizer_weights import metric



async def slow_push(address: str, frames: list[bytes], pause: float) -> None:
    """A trainer pushing chunk by chunk, slowly: readers downstream see the version while it arrives."""
    async def paced():
        for frame in frames:
            yield frame
            await asyncio.sleep(pause)

    async with open_channel(address, max_attempts=1) as channel:
        push = channel.stream_unary("/flywheel.synchronizer.v1.SynchronizerService/PushWeights",
                                    request_serializer=None, response_deserializer=pb.PushWeightsResponse.FromString)
        await push(paced(), timeout=60)


async def test_a_relay_fetches_once_serves_a_joining_reader_and_crosses_later_versions_as_deltas() -> None:
    v1 = model()
    v2 = step(v1, 2)
    # The slow link: what crosses it is counted by a forwarder between the relay and its upstream.
    async with embedded_synchronizer(keep_versions=2) as upstream, \
            CutProxy("127.0.0.1", int(upstream.address.rsplit(":", 1)[1])) as link, \
            embedded_synchronizer(relay={"upstream": link.address, "site": "far-a",
                                         "heartbeat_interval_seconds": 0.2}) as relay, \
            SynchronizerClient(relay.address, shared_memory=False) as site, \
            SynchronizerClient(upstream.address) as central:
        # The relay registered upstream as the site's synchronizer: that is how replicas find it.
        for _ in range(50):
            relays = [c for c in (await central.status()).components if c.role is Role.SYNCHRONIZER]
            if relays:
                break
            await asyncio.sleep(0.1)
        assert relays and relays[0].identity.labels == {"site": "far-a"} and relays[0].identity.address

        frames = list(encoded_frames(encode_state_dict(v1, 1, chunk_bytes=32 * 1024)))
        push = asyncio.ensure_future(slow_push(upstream.address, frames, pause=0.02))
        first = asyncio.ensure_future(site.pull_weights(1, wait_seconds=20))
        await asyncio.sleep(0.3)  # version 1 is arriving: the relay streams it on as it lands
        assert not push.done() and not first.done()
        joined = asyncio.ensure_future(site.pull_weights(1, wait_seconds=20))  # a replica joining mid-transfer
        await push
        a, b = await first, await joined
        assert same(a.tensors, v1) and same(b.tensors, v1)
        upstream_sent = link.downstream_bytes
        full = sum(t.numel() * t.element_size() for t in v1.values())
        assert full <= upstream_sent < 1.05 * full  # one copy crossed, whatever the site's readers

        # Version 2 crosses as a delta from the version the relay holds, and is served in full or as a delta.
        # (The metric is the process's: both servers, and earlier tests' in-process servers, count into it.)
        deltas_before = metric(upstream.metrics_url, 'flywheel_synchronizer_delta_pulls_total{sent="delta"}')
        await central.push_weights(v2, 2)
        full_v2 = await site.pull_weights(2)
        assert same(full_v2.tensors, v2)
        assert metric(upstream.metrics_url, 'flywheel_synchronizer_delta_pulls_total{sent="delta"}') == deltas_before + 1
        crossed = link.downstream_bytes - upstream_sent
        assert crossed < 0.2 * full
        held = DeltaBase(1, identify(v1), v1)
        from_relay = await site.pull_weights(2, base=held)
        assert from_relay.stats.delta_base == 1 and same(from_relay.tensors, v2)

        # The relay only holds bytes: pushes go upstream.
        with pytest.raises(FailedPrecondition, match="relay"):
            await site.push_weights(v2, 3)
