"""Addresses others will dial are checked where they are given: INVALID_ARGUMENT naming the field,
not UNAVAILABLE later when somebody dials them."""

from __future__ import annotations

import pytest

from flywheel.errors import InvalidArgument
from flywheel.runtime.addresses import check_address
from flywheel.synchronizer.client import SynchronizerClient
from services.synchronizer.embedded import embedded_synchronizer


@pytest.mark.parametrize("good", ["127.0.0.1:50051", "flywheel-relay:50061", "[::1]:80", "rollout-0.svc.cluster.local:1"])
def test_host_port_forms_pass(good: str) -> None:
    assert check_address(good, "f") == good


@pytest.mark.parametrize("bad, why", [
    ("nohost", "expected host:port"), ("host:0", "not in 1-65535"), ("host:99999", "not in 1-65535"),
    (":80", "expected host:port"), ("::1:80", "needs brackets"), ("[::1:80", "bracketed IPv6"),
    ("bad host:80", "not a host name"), ("host:8o", "not in 1-65535"),
])
def test_malformed_addresses_are_refused_naming_the_field(bad: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=f"identity.address: .*{why}"):
        check_address(bad, "identity.address")


async def test_a_component_registering_with_a_malformed_address_is_refused_up_front() -> None:
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as client:
        with pytest.raises(InvalidArgument, match="identity.address: 'rollout-7': expected host:port") as info:
            await client.register("rollout", "r7", address="rollout-7")
        assert info.value.code == "INVALID_ARGUMENT"
        assert not [c for c in (await client.status()).components if c.id == "r7"]
        await client.register("rollout", "r7", address="rollout-7:50053")  # the same, well formed


def test_an_nccl_update_naming_a_malformed_rendezvous_is_refused_before_any_call() -> None:
    from flywheel.rollout.v1 import rollout_pb2 as pb
    from services.rollout.servicer import _nccl_target

    with pytest.raises(InvalidArgument, match="nccl.rendezvous_address: '10.0.0.1': expected host:port"):
        _nccl_target(pb.NcclSource(group_id="g", rendezvous_address="10.0.0.1", rank=1), "127.0.0.1:1")
    target = _nccl_target(pb.NcclSource(group_id="g", rendezvous_address="10.0.0.1:29600", rank=1), "127.0.0.1:1")
    assert target.rendezvous_address == "10.0.0.1:29600"
