"""The server bootstrap in-process: error mapping, deadlines, retries, ready file."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from flywheel.controller.v1 import controller_pb2 as pb
from flywheel.controller.v1 import controller_pb2_grpc as pb_grpc
from flywheel.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from flywheel.runtime.client import open_channel
from flywheel.runtime.server import RunningServer, ServiceSpec, serve
from flywheel.runtime.server_config import ServerConfig
from flywheel.testing.net import free_port


class CodecStyleError(Exception):
    """Like the codec's errors: not a FlywheelError, but carries a status name."""

    code = "DATA_LOSS"


RAISES = {
    "invalid": InvalidArgument("batch.input_ids: expected 2 dims, got 3"),
    "precondition": FailedPrecondition("component trainer-0 is STOPPED, cannot go to WAITING_SYNC"),
    "exhausted": ResourceExhausted("queue full"),
    "data_loss": DataLoss("chunk 3 checksum mismatch"),
    "codec": CodecStyleError("digest mismatch"),
    "bug": ZeroDivisionError("division by zero"),
    "unimplemented": NotImplementedError(),
}


class ScriptedController(pb_grpc.ControllerServiceServicer):
    """Start raises what `run_id` names; Stop sleeps; StreamMetrics fails midway."""

    async def Start(self, request: pb.StartRequest, context) -> pb.StartResponse:
        raise RAISES[request.run_id]

    async def Stop(self, request: pb.StopRequest, context) -> pb.StopResponse:
        await asyncio.sleep(request.grace_seconds)
        return pb.StopResponse()

    async def StreamMetrics(self, request: pb.StreamMetricsRequest, context) -> AsyncIterator[pb.StreamMetricsResponse]:
        yield pb.StreamMetricsResponse(step=1)
        raise InvalidArgument("after_step: beyond the last step")


async def _start(port: int = 0, token: str | None = None, ready_file: Path | None = None, startup=None):
    stop = asyncio.Event()
    ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    servicer = ScriptedController()
    spec = ServiceSpec(
        name="test",
        proto_services=["flywheel.controller.v1.ControllerService"],
        register=lambda server: pb_grpc.add_ControllerServiceServicer_to_server(servicer, server),
        startup=startup,
    )
    config = ServerConfig(port=port, metrics_port=0, auth_token=token, ready_file=ready_file, shutdown_grace_seconds=0.5)
    task = asyncio.ensure_future(serve(spec, config, stop=stop, on_ready=ready.set_result))
    return stop, task, ready


@pytest.fixture
async def server():
    stop, task, ready = await _start()
    running = await asyncio.wait_for(ready, 10)
    yield f"127.0.0.1:{running.grpc_port}"
    stop.set()
    await task


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
        ("precondition", grpc.StatusCode.FAILED_PRECONDITION),
        ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("data_loss", grpc.StatusCode.DATA_LOSS),
        ("codec", grpc.StatusCode.DATA_LOSS),
        ("bug", grpc.StatusCode.INTERNAL),
        ("unimplemented", grpc.StatusCode.UNIMPLEMENTED),
    ],
)
async def test_domain_errors_become_status_codes(server: str, name: str, code: grpc.StatusCode) -> None:
    async with open_channel(server, max_attempts=1) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.ControllerServiceStub(channel).Start(pb.StartRequest(run_id=name))
    assert err.value.code() == code
    if name not in ("unimplemented",):
        assert str(RAISES[name]) in err.value.details()


async def test_error_inside_a_stream_ends_it_with_the_mapped_status(server: str) -> None:
    received = []
    async with open_channel(server, max_attempts=1) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in pb_grpc.ControllerServiceStub(channel).StreamMetrics(pb.StreamMetricsRequest()):
                received.append(item.step)
    assert received == [1]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "after_step" in err.value.details()


async def test_every_call_is_counted_once_under_its_status(server: str) -> None:
    def count(method: str, code: str) -> float:
        labels = {"service": "test", "method": method, "code": code}
        return REGISTRY.get_sample_value("flywheel_rpc_requests_total", labels) or 0.0

    calls = [("Stop", "OK"), ("Start", "INVALID_ARGUMENT"), ("StreamMetrics", "INVALID_ARGUMENT")]
    before = {call: count(*call) for call in calls}
    async with open_channel(server, max_attempts=1) as channel:
        stub = pb_grpc.ControllerServiceStub(channel)
        await stub.Stop(pb.StopRequest())
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Start(pb.StartRequest(run_id="invalid"))
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub.StreamMetrics(pb.StreamMetricsRequest()):
                pass
    assert {call: count(*call) - before[call] for call in calls} == dict.fromkeys(calls, 1.0)


@pytest.mark.parametrize("method", ["Start", "StreamMetrics"])
@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x05ab"], ids=["garbage", "truncated"])
async def test_bytes_that_are_no_request_get_invalid_argument_and_the_server_goes_on(
    server: str, method: str, data: bytes
) -> None:
    async with open_channel(server, max_attempts=1) as channel:
        path = f"/flywheel.controller.v1.ControllerService/{method}"
        call = (channel.unary_unary if method == "Start" else channel.unary_stream)(path)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            result = call(data, timeout=5)
            if method == "Start":
                await result
            else:
                async for _ in result:
                    pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a valid flywheel.controller.v1." in err.value.details()
        # The next good request is served as ever.
        await pb_grpc.ControllerServiceStub(channel).Stop(pb.StopRequest(grace_seconds=0), timeout=5)


def test_enum_values_the_schema_does_not_define_are_refused_naming_the_field() -> None:
    from flywheel.common.v1 import common_pb2
    from flywheel.runtime.requests import BadRequest, checked

    parse = checked(common_pb2.ComponentIdentity.FromString)
    good = common_pb2.ComponentIdentity(role=common_pb2.COMPONENT_ROLE_ROLLOUT, capabilities=[1, 2], labels={"a": "b"})
    assert parse(good.SerializeToString()) == good
    bad_role = common_pb2.ComponentIdentity(role=9).SerializeToString()
    assert parse(bad_role) == BadRequest("role: 9 is not a ComponentRole value (one of COMPONENT_ROLE_UNSPECIFIED, "
                                         "COMPONENT_ROLE_TRAINER, COMPONENT_ROLE_ROLLOUT, COMPONENT_ROLE_CONTROLLER, "
                                         "COMPONENT_ROLE_SYNCHRONIZER)")
    nested = common_pb2.ComponentStatus(identity=common_pb2.ComponentIdentity(capabilities=[2, 10]))
    assert parse_status(nested).reason.startswith("identity.capabilities[1]: 10 is not a SyncMethod value")


def parse_status(message):
    from flywheel.common.v1 import common_pb2
    from flywheel.runtime.requests import checked

    return checked(common_pb2.ComponentStatus.FromString)(message.SerializeToString())


async def test_a_bad_message_in_a_request_stream_fails_the_call_after_the_good_ones() -> None:
    from flywheel.runtime.requests import BadRequest, admit_each

    async def stream():
        yield 1
        yield BadRequest("chunk 2: not a WeightChunk")
        yield 3

    seen = []
    with pytest.raises(InvalidArgument, match="chunk 2"):
        async for item in admit_each(stream()):
            seen.append(item)
    assert seen == [1]


async def test_every_call_gets_a_default_deadline(server: str) -> None:
    async with open_channel(server, max_attempts=1, default_timeout=0.3) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.ControllerServiceStub(channel).Stop(pb.StopRequest(grace_seconds=5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # An explicit timeout still wins over the default.
        await pb_grpc.ControllerServiceStub(channel).Stop(pb.StopRequest(grace_seconds=0.5), timeout=5)


async def test_unavailable_is_retried_until_the_server_comes_up(tmp_path: Path) -> None:
    port = free_port()
    async with open_channel(f"127.0.0.1:{port}", max_attempts=5) as channel:
        call = asyncio.ensure_future(pb_grpc.ControllerServiceStub(channel).Status(pb.StatusRequest(), timeout=20))
        await asyncio.sleep(0.6)  # the first attempts fail with UNAVAILABLE
        stop, task, ready = await _start(port=port, ready_file=tmp_path / "ready.json")
        await asyncio.wait_for(ready, 10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        # It reached the server (whose Status is not implemented) instead of failing UNAVAILABLE.
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        stop.set()
        await task
    info = json.loads((tmp_path / "ready.json").read_text())
    assert info["grpc_port"] == port and info["service"] == "test"


async def test_not_serving_until_startup_finishes() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    release = asyncio.Event()
    port = free_port()
    stop, task, ready = await _start(port=port, startup=release.wait)
    async with open_channel(f"127.0.0.1:{port}", max_attempts=1) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(50):  # wait for the listener
            try:
                before = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        assert before.status == health_pb2.HealthCheckResponse.NOT_SERVING
        release.set()
        await asyncio.wait_for(ready, 10)
        after = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert after.status == health_pb2.HealthCheckResponse.SERVING
    stop.set()
    await task
