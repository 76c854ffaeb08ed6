"""Delta and resumable pulls over real gRPC: a replica that holds version M is
sent N as what changed, verified against N's identity; a base the
synchronizer no longer holds (or other weights under its number) gets the
full version; a drifted base is refused whole; a broken stream resumes where
it broke."""

from __future__ import annotations

import grpc
import pytest
import torch

from flywheel.codec import DigestMismatch
from flywheel.codec.identity import identify
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import DeltaBase
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.testing.cut_proxy import CutProxy
from services.synchronizer.embedded import embedded_synchronizer
from tests.integration.test_synchronizer_weights import metric, same


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small bfloat16 model: what a GPU deployment publishes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(256, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.03) -> dict[str, torch.Tensor]:
    """One small training step: about `fraction` of the values of the matrices move."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if t.dim() == 2:
            mask = torch.rand(t.shape, generator=g) < fraction
            t[mask] = (t.float()[mask] * 1.01 + 1e-3).to(t.dtype)
        out[name] = t
    return out


def base_of(version: int, tensors: dict[str, torch.Tensor]) -> DeltaBase:
    return DeltaBase(version, identify(tensors), tensors)


async def test_a_delta_pull_rebuilds_the_version_bit_exact_for_a_fraction_of_its_bytes() -> None:
    v1 = model()
    v2 = step(v1, 2)
    v3 = step(v2, 3)
    async with embedded_synchronizer(keep_versions=3) as server, SynchronizerClient(server.address) as c:
        deltas_before = metric(server.metrics_url, 'flywheel_synchronizer_delta_pulls_total{sent="delta"}')
        for version, state in ((1, v1), (2, v2), (3, v3)):
            await c.push_weights(state, version)
        held = (await c.pull_weights(1)).tensors
        full = await c.pull_weights(3)
        for base_version, base in ((2, v2), (1, held)):  # the previous step, and a replica two behind
            pulled = await c.pull_weights(3, base=base_of(base_version, base))
            assert pulled.stats.delta_base == base_version
            assert same(pulled.tensors, full.tensors) and same(pulled.tensors, v3)
            assert pulled.identity == full.identity and pulled.nbytes == full.nbytes
            assert pulled.stats.stream_bytes < 0.15 * full.nbytes, pulled.stats
        # Into a destination: written only after the result is verified.
        # (The metric is the process's: earlier tests' in-process servers count into it too.)
        into = {k: torch.zeros_like(t) for k, t in v3.items()}
        pulled = await c.pull_weights(3, base=base_of(2, v2), into=into)
        assert pulled.tensors is not None and same(into, v3)
        assert metric(server.metrics_url, 'flywheel_synchronizer_delta_pulls_total{sent="delta"}') == deltas_before + 3


async def test_a_base_not_held_or_not_the_same_weights_gets_the_full_version() -> None:
    v1 = model()
    versions = {1: v1}
    for v in range(2, 5):
        versions[v] = step(versions[v - 1], v)
    async with embedded_synchronizer(keep_versions=2) as server, SynchronizerClient(server.address) as c:
        for version, state in versions.items():
            await c.push_weights(state, version)
        # Version 1 was evicted (keep 2): the replica is sent version 4 whole.
        pulled = await c.pull_weights(4, base=base_of(1, v1))
        assert pulled.stats.delta_base == 0 and same(pulled.tensors, versions[4])
        assert pulled.stats.stream_bytes + pulled.stats.shared_bytes == pulled.nbytes
        # The replica's "version 3" is other weights (another lineage): its identity says so, and the
        # synchronizer does not make a delta it could not apply.
        other = model(seed=7)
        pulled = await c.pull_weights(4, base=base_of(3, other))
        assert pulled.stats.delta_base == 0 and same(pulled.tensors, versions[4])


async def test_a_drifted_base_is_refused_whole_and_the_destination_untouched() -> None:
    v1 = model()
    v2 = step(v1, 2)
    async with embedded_synchronizer(keep_versions=2) as server, SynchronizerClient(server.address) as c:
        await c.push_weights(v1, 1)
        await c.push_weights(v2, 2)
        # The replica claims version 1's identity but one of its values changed in memory since.
        drifted = {k: t.clone() for k, t in v1.items()}
        drifted["lm_head.weight"][3, 3] += 1
        into = {k: t.clone() for k, t in v1.items()}
        with pytest.raises(DigestMismatch, match="lm_head.weight|differs"):
            await c.pull_weights(2, base=DeltaBase(1, identify(v1), drifted), into=into)
        assert same(into, v1)


async def test_a_base_without_its_identity_is_refused() -> None:
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        await c.push_weights(model(), 1)
        await c.push_weights(step(model(), 2), 2)
        async with open_channel(server.address, max_attempts=1) as channel:
            pull = channel.unary_stream("/flywheel.synchronizer.v1.SynchronizerService/PullWeights",
                                        request_serializer=pb.PullWeightsRequest.SerializeToString,
                                        response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in pull(pb.PullWeightsRequest(version=2, base_version=1), timeout=10):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Resuming with the digest of another stream is refused: its chunks would not be one version.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in pull(pb.PullWeightsRequest(version=2, resume_from=3, resume_digest=b"x" * 16),
                                    timeout=10):
                    pass
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("as_delta", [False, True], ids=["full", "delta"])
async def test_a_cut_stream_resumes_without_resending_what_arrived(as_delta: bool) -> None:
    v1 = model()
    v2 = step(v1, 2, fraction=0.5) if as_delta else model(seed=5)
    async with embedded_synchronizer(keep_versions=2) as server, CutProxy("127.0.0.1", int(server.address.rsplit(":", 1)[1])) as proxy:
        async with SynchronizerClient(server.address, shared_memory=False) as direct:
            await direct.push_weights(v1, 1, chunk_bytes=64 * 1024)
            await direct.push_weights(v2, 2, chunk_bytes=64 * 1024)
            whole = await direct.pull_weights(2, base=base_of(1, v1) if as_delta else None)
        async with SynchronizerClient(proxy.address, shared_memory=False) as far:
            proxy.cut_after(whole.stats.stream_bytes // 2)
            pulled = await far.pull_weights(2, base=base_of(1, v1) if as_delta else None)
        assert proxy.cuts == 1 and pulled.stats.resumes == 1
        assert same(pulled.tensors, v2)
        assert (pulled.stats.delta_base == 1) is as_delta
        # Only what had not arrived was sent again: the chunk cut in half, at most. The forwarder also
        # counts what was in flight to the replica when the connection was reset (socket buffers the
        # reset discards): a transfer resumed from the last chunk received must send those again.
        assert pulled.stats.stream_bytes <= whole.stats.stream_bytes + 64 * 1024
        assert proxy.downstream_bytes <= whole.stats.stream_bytes + 512 * 1024


@pytest.mark.parametrize("lease_bytes", [1 << 30, 0], ids=["leased", "no-lease-budget"])
async def test_the_version_a_live_replica_serves_is_kept_as_its_delta_base(lease_bytes: int) -> None:
    versions = {1: model()}
    for v in range(2, 5):
        versions[v] = step(versions[v - 1], v)
    async with embedded_synchronizer(keep_versions=2, delta_base_bytes=lease_bytes, lease_seconds=30) as server, \
            SynchronizerClient(server.address, shared_memory=False) as c:
        await c.push_weights(versions[1], 1)
        # A replica serves version 1 (a far one that lags): its lease keeps version 1 past keep_versions.
        await c.register("rollout", "far-0", weight_version=1, weight_identity=identify(versions[1]).digest)
        for v in (2, 3, 4):
            await c.push_weights(versions[v], v)
        kept = [v.version for v in (await c.status()).versions if v.in_memory]
        assert kept == [3, 4]  # a lease keeps a base for deltas; it is not a version to pull
        pulled = await c.pull_weights(4, base=base_of(1, versions[1]))
        assert same(pulled.tensors, versions[4])
        assert pulled.stats.delta_base == (1 if lease_bytes else 0)


async def test_a_compressed_pull_is_the_version_in_fewer_bytes_and_only_where_the_link_is_slow() -> None:
    from flywheel.synchronizer import pull

    v1 = model()
    async with embedded_synchronizer() as server, CutProxy("127.0.0.1", int(server.address.rsplit(":", 1)[1])) as proxy:
        async with SynchronizerClient(server.address, shared_memory=False) as direct:
            await direct.push_weights(v1, 1, chunk_bytes=64 * 1024)
        async with SynchronizerClient(proxy.address, shared_memory=False, compress=True) as far:
            pulled = await far.pull_weights(1)
        assert same(pulled.tensors, v1) and pulled.stats.compressed
        assert proxy.downstream_bytes < 0.9 * pulled.nbytes  # bfloat16 weights compress by about a fifth
        assert pulled.stats.stream_bytes < 0.9 * pulled.nbytes
        # Auto: a link measured fast is not compressed, one measured slow is.
        async with SynchronizerClient(server.address, shared_memory=False) as auto:
            assert not (await auto.pull_weights(1)).stats.compressed  # unknown at first: measured by this pull
            assert not (await auto.pull_weights(1)).stats.compressed  # loopback is far above the threshold
            pull._LINK_RATES[server.address] = 10e6  # as a 100 Mbit/s link measures
            slow = await auto.pull_weights(1)
            assert slow.stats.compressed and same(slow.tensors, v1)
