"""Each service as a real process: health, auth, every RPC, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from flywheel.controller.v1 import controller_pb2
from flywheel.launcher.processes import SERVICES
from flywheel.rollout.v1 import rollout_pb2
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.v1 import synchronizer_pb2
from flywheel.trainer.v1 import trainer_pb2
from tests.conftest import TEST_TOKEN

DESCRIPTORS = {
    "synchronizer": synchronizer_pb2.DESCRIPTOR.services_by_name["SynchronizerService"],
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    "rollout": rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
    "controller": controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
}


async def _call(channel: grpc.aio.Channel, method, timeout: float = 5.0) -> grpc.StatusCode:
    """Calls any RPC with an empty request; returns the status it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    kw = dict(request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kw)(iter([request_cls()]), timeout=timeout)
            async for _ in call:
                pass
        elif method.client_streaming:
            await channel.stream_unary(path, **kw)(iter([request_cls()]), timeout=timeout)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, **kw)(request_cls(), timeout=timeout):
                pass
        else:
            await channel.unary_unary(path, **kw)(request_cls(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _call_raw(channel: grpc.aio.Channel, method, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Calls an RPC with `data` as the request's bytes (a stream's only message); its status and details."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            kind = channel.stream_stream if method.server_streaming else channel.stream_unary
            call = kind(path)(iter([data]), timeout=5)
        else:
            call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(path)(data, timeout=5)
        if method.server_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("name", SERVICES)
async def test_service_is_healthy_and_guards_every_rpc(name: str, run_service) -> None:
    child = run_service(name)
    service = DESCRIPTORS[name]

    async with open_channel(child.grpc_address, token="wrong-token", max_attempts=1) as channel:
        # Health answers without a valid token (probes and load balancers hold none).
        health = health_pb2_grpc.HealthStub(channel)
        for service_name in ("", service.full_name):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        for method in service.methods:
            assert await _call(channel, method) == grpc.StatusCode.UNAUTHENTICATED, method.name

    async with open_channel(child.grpc_address, token=TEST_TOKEN, max_attempts=1) as channel:
        codes = {method.name: await _call(channel, method) for method in service.methods}
    # An empty request gets a real answer: OK, a precise rejection of the empty
    # request, or UNIMPLEMENTED — never an internal error, a hang or an auth failure.
    answered = {
        grpc.StatusCode.OK,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    }
    bad = {m: c.name for m, c in codes.items() if c not in answered}
    assert not bad, bad
    assert grpc.StatusCode.OK in codes.values(), "each service answers at least its status RPC for real"

    # Bytes that are no request at all are refused as the client's error, on every RPC, and the server goes on.
    async with open_channel(child.grpc_address, token=TEST_TOKEN, max_attempts=1) as channel:
        for garbage in (b"\xff\xff\xff", b"\x0a\x05ab"):
            codes = {method.name: await _call_raw(channel, method, garbage) for method in service.methods}
            # (PushWeights takes raw frames and checks them itself, with its own words.)
            bad = {m: c for m, c in codes.items() if c[0] != grpc.StatusCode.INVALID_ARGUMENT or not c[1]}
            assert not bad, (garbage, bad)
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_missing_token_is_unauthenticated(run_service, monkeypatch: pytest.MonkeyPatch) -> None:
    child = run_service("trainer")
    # A client with no token at all (none given, none in its environment).
    monkeypatch.delenv("FLYWHEEL_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("FLYWHEEL_AUTH_TOKEN_FILE", raising=False)
    async with open_channel(child.grpc_address, token=None, max_attempts=1) as channel:
        code = await _call(channel, DESCRIPTORS["trainer"].methods_by_name["GetInfo"])
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_reflection_lists_the_services(run_service) -> None:
    child = run_service("synchronizer")
    async with open_channel(child.grpc_address, token=TEST_TOKEN, max_attempts=1) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        async for response in responses:
            names = {s.name for s in response.list_services_response.service}
            break
    assert {"flywheel.synchronizer.v1.SynchronizerService", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint_exports_flywheel_metrics(run_service) -> None:
    child = run_service("controller")
    asyncio.run(_status_call(child.grpc_address))
    text = urllib.request.urlopen(child.metrics_url, timeout=5).read().decode()
    assert 'flywheel_service_ready{service="controller"} 1.0' in text
    assert 'flywheel_rpc_requests_total{code="OK",method="Status",service="controller"} 1.0' in text
    assert "flywheel_rpc_duration_seconds_bucket" in text


async def _status_call(address: str) -> None:
    async with open_channel(address, token=TEST_TOKEN) as channel:
        await _call(channel, DESCRIPTORS["controller"].methods_by_name["Status"])


async def test_sigterm_reports_not_serving_then_exits_cleanly(run_service) -> None:
    child = run_service("rollout", "--server.shutdown-grace-seconds", "2")
    async with open_channel(child.grpc_address, max_attempts=1) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        child.process.send_signal(signal.SIGTERM)
        second = await watch.read()
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await asyncio.to_thread(child.process.wait, 30) == 0
    log = child.log_path.read_text()
    assert '"msg": "stopped"' in log


@pytest.mark.parametrize("name", SERVICES)
def test_help_is_instant_and_imports_no_engine(name: str) -> None:
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['services.{name}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('services.{name}', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
        "print('HEAVY', sorted(m for m in ('torch', 'vllm', 'transformers', 'grpc') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--server.port" in result.stdout
    assert "HEAVY []" in result.stdout


def test_bad_config_exits_naming_the_field(service_env) -> None:
    env = dict(service_env, FLYWHEEL_SYNCHRONIZER__SERVER__PORT="eighty")
    result = subprocess.run(
        [sys.executable, "-m", "services.synchronizer"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "server.port" in result.stderr and "FLYWHEEL_SYNCHRONIZER__SERVER__PORT" in result.stderr


def test_flywheel_up_check_starts_all_four(tmp_path, service_env) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "up", "--check", "--status-port", "0", "--run-dir", str(tmp_path)],
        env=service_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SERVING") == len(SERVICES)
    assert "stopped: synchronizer (exit 0), trainer (exit 0), rollout (exit 0), controller (exit 0)" in result.stdout


#: Starts `flywheel up` as a shell starts a background job: with SIGINT ignored (an exec keeps that).
_SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, '-m', 'flywheel.cli', *sys.argv[1:]])")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_flywheel_up_stops_its_services_on_a_signal_whatever_it_inherited(tmp_path, service_env, stop) -> None:
    """Ctrl-C (or `kill -INT`) and a supervisor's SIGTERM both stop the services and report their exits,
    also when `up` started as a background job with SIGINT ignored: it once waited that SIGINT out."""
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        up = subprocess.Popen([sys.executable, "-c", _SIGINT_IGNORED, "up", "--status-port", "0", "--run-dir",
                               str(tmp_path)], env=service_env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "all services up" not in out.read_text():
            assert up.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        up.send_signal(stop)
        code = up.wait(60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    output = out.read_text()
    assert code == 0, output
    assert "stopped: synchronizer (exit 0), trainer (exit 0), rollout (exit 0), controller (exit 0)" in output


def test_flywheel_up_with_tinker_serves_the_tinker_api(tmp_path, service_env) -> None:
    env = dict(service_env, FLYWHEEL_MODEL_CACHE=str(tmp_path / "models"))
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "up", "--with", "tinker", "--tinker-port", "0", "--lora-rank", "4",
         "--status-port", "0", "--check", "--run-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SERVING") == len(SERVICES) + 1 and "tinker" in result.stdout
    assert "Tinker API: TINKER_BASE_URL=http://127.0.0.1:" in result.stdout and "-untied" in result.stdout
    assert "stopped: synchronizer (exit 0), trainer (exit 0), rollout (exit 0), controller (exit 0), tinker (exit 0)" \
        in result.stdout
