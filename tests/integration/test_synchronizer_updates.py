"""Fleet updates over gRPC: a rollout's update reports, the ledger, versions
asked for, identities in Status and on Watch; malformed reports refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flywheel.codec import identify
from flywheel.errors import InvalidArgument
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.types import (
    EventKind, UpdateOutcome, UpdatePhase, UpdateRecord, UpdateTimings,
)
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc
from services.synchronizer.embedded import embedded_synchronizer
from tests.unit.synchronizer.sync_helpers import measured_all, small_state


async def test_reports_ledger_and_requests_round_trip() -> None:
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        await c.register("trainer", "t", address="127.0.0.1:1", capabilities=["memory"])
        await c.register("rollout", "r", capabilities=["memory"])
        events = c.watch([], send_initial=False)
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.1)

        assert await c.request_version(1, "start of the run") == 0
        asked = await asyncio.wait_for(first, 5)
        assert asked.kind == EventKind.VERSION_REQUESTED and asked.version == 1
        decision = await c.need_sync("t", 1)
        assert decision.need_sync and decision.version == 1
        await c.push_weights(small_state(1), 1)
        committed = await asyncio.wait_for(anext(events), 5)
        while committed.kind != EventKind.VERSION_COMMITTED:
            committed = await asyncio.wait_for(anext(events), 5)
        assert committed.identity == identify(small_state(1)).digest
        status = await c.status()
        assert status.version(1).identity == committed.identity and status.version(1).epoch == 0

        timings = UpdateTimings(0.01, 0.2, 0.05, 0.02, 0.001, 0.081)
        record = await c.report_update(UpdateRecord("r", 1, UpdateOutcome.VERIFIED, resident_identity=b"\x00" * 16,
                                                    timings=timings, served_version=1))
        assert record.outcome == UpdateOutcome.FAILED and record.failed_phase == UpdatePhase.VERIFY
        assert record.timings == timings and record.expected_identity == committed.identity
        reported = await asyncio.wait_for(anext(events), 5)
        while reported.kind != EventKind.UPDATE_REPORTED:
            reported = await asyncio.wait_for(anext(events), 5)
        assert reported.update == record and reported.component.quarantined
        assert (await c.status()).component("r").quarantined

        # Verified means measured: the right identity, with every tensor hashed where it sits.
        every = measured_all(len(small_state()))
        good = await c.report_update(UpdateRecord("r", 1, UpdateOutcome.VERIFIED, resident_identity=committed.identity,
                                                  served_version=1, coverage=every))
        assert good.verified and good.coverage == every and not (await c.status()).component("r").quarantined
        assert [r.outcome for r in await c.list_updates(1)] == [UpdateOutcome.VERIFIED]
        await events.aclose()


@pytest.mark.parametrize("request_, field", [
    (pb.ReportUpdateRequest(id="r", version=1, outcome=1, resident_identity=b"short"), "resident_identity"),
    (pb.ReportUpdateRequest(id="r", version=1, outcome=2), "failed_phase"),
    (pb.ReportUpdateRequest(id="r", version=0, outcome=2, failed_phase=3), "version"),
    (pb.ReportUpdateRequest(id="r", version=1, outcome=7), "outcome"),
    (pb.ReportUpdateRequest(id="r", version=1, outcome=2, failed_phase=3,
                            timings=pb.UpdateTimings(apply_seconds=-1)), "timings"),
    (pb.ReportUpdateRequest(id="", version=1, outcome=2, failed_phase=3), "id"),
    (pb.ReportUpdateRequest(id="r", version=1, outcome=3,
                            coverage=pb.UpdateCoverage(tensors=2, resident_tensors=2, received_tensors=1)), "coverage"),
])
async def test_malformed_reports_are_refused_and_change_nothing(request_, field: str) -> None:
    async with embedded_synchronizer() as server, SynchronizerClient(server.address) as c:
        await c.register("rollout", "r", capabilities=["memory"])
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.SynchronizerServiceStub(channel).ReportUpdate(request_, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
        assert await c.list_updates() == [] and not (await c.status()).component("r").quarantined
        with pytest.raises(InvalidArgument, match="min_version"):
            await c.request_version(0)
