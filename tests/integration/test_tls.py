"""TLS through real processes, with a CA made for the test: every listener (gRPC, the
rollout's HTTP API, /metrics) serves TLS only; a client that verifies with the CA gets
through, a plaintext client and a client trusting another CA do not; under mutual TLS
a client without a certificate is refused, and the services still reach each other."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from flywheel.launcher.certs import make_pki
from flywheel.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from flywheel.runtime.client import open_channel
from flywheel.runtime.tls import TlsFiles
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.v1 import synchronizer_pb2, synchronizer_pb2_grpc
from flywheel.runtime.http_server import http_ready_file
from tests.conftest import TEST_TOKEN

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pki(tmp_path: Path):
    return make_pki(tmp_path / "pki")


@pytest.fixture
def other_pki(tmp_path: Path):
    return make_pki(tmp_path / "other-pki")


def _tls_env(service_env: dict[str, str], pki, *, mutual: bool = False) -> dict[str, str]:
    env = {**service_env, "FLYWHEEL_TLS_CERT_FILE": str(pki.cert_file), "FLYWHEEL_TLS_KEY_FILE": str(pki.key_file),
           "FLYWHEEL_TLS_CA_FILE": str(pki.ca_file)}
    if mutual:
        env["FLYWHEEL_TLS_CLIENT_CA_FILE"] = str(pki.ca_file)
    return env


async def _rollout_status(address: str, tls: TlsFiles) -> grpc.StatusCode:
    async with open_channel(address, token=TEST_TOKEN, max_attempts=1, default_timeout=5, tls=tls) as channel:
        try:
            await rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(rollout_pb2.GetStatusRequest())
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_tls_rollout_refuses_plaintext_and_other_cas(run_service, service_env, pki, other_pki) -> None:
    env = _tls_env(service_env, pki)
    child = run_service("rollout", env=env)
    verified = TlsFiles(ca_file=pki.ca_file)
    assert await _rollout_status(child.grpc_address, verified) == grpc.StatusCode.OK
    assert await _rollout_status(child.grpc_address, TlsFiles()) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert await _rollout_status(child.grpc_address, TlsFiles(ca_file=other_pki.ca_file)) == grpc.StatusCode.UNAVAILABLE
    # A name the certificate does not hold is refused too: the client checks the name it expects.
    async with open_channel(child.grpc_address, token=TEST_TOKEN, max_attempts=1, default_timeout=5, tls=verified,
                            extra_options=[("grpc.ssl_target_name_override", "elsewhere.example")]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(rollout_pb2.GetStatusRequest())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # The containers' healthcheck asks over TLS when the container has the TLS variables.
    healthcheck = [sys.executable, str(ROOT / "deploy/docker/healthcheck.py"), child.grpc_address]
    assert subprocess.run(healthcheck, env=env, capture_output=True, cwd=ROOT).returncode == 0
    assert subprocess.run(healthcheck, env=service_env, capture_output=True, cwd=ROOT).returncode == 1

    http_port = json.loads(http_ready_file(child.ready_path).read_text())["http_port"]
    headers = {"authorization": f"Bearer {TEST_TOKEN}"}
    trusting = ssl.create_default_context(cafile=str(pki.ca_file))
    async with httpx.AsyncClient(verify=trusting, timeout=30) as http:
        models = await http.get(f"https://127.0.0.1:{http_port}/v1/models", headers=headers)
        assert models.status_code == 200, models.text
        metrics = await http.get(f"https://127.0.0.1:{child.info['metrics_port']}/metrics")
        assert metrics.status_code == 200 and "flywheel_service_ready" in metrics.text
    async with httpx.AsyncClient(timeout=10) as plain:
        with pytest.raises(httpx.TransportError):
            await plain.get(f"http://127.0.0.1:{http_port}/v1/models", headers=headers)
        with pytest.raises(httpx.TransportError):
            await plain.get(f"http://127.0.0.1:{child.info['metrics_port']}/metrics")
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(other_pki.ca_file)), timeout=10) as other:
        with pytest.raises(httpx.ConnectError):
            await other.get(f"https://127.0.0.1:{http_port}/v1/models", headers=headers)


async def test_mutual_tls_services_reach_each_other_and_clients_need_a_certificate(
    run_service, service_env, pki, tmp_path: Path
) -> None:
    env = _tls_env(service_env, pki, mutual=True)
    synchronizer = run_service("synchronizer", "--server.metrics-auth", "true", env=env)
    # The trainer registers with the synchronizer over mutual TLS, presenting its own certificate.
    run_service("trainer", "--sync.synchronizer-address", synchronizer.grpc_address, "--sync.trainer-id", "trainer-m",
                env=env)
    with_certificate = TlsFiles(ca_file=pki.ca_file, cert_file=pki.cert_file, key_file=pki.key_file)
    async with SynchronizerClient(synchronizer.grpc_address, TEST_TOKEN, timeout=10, tls=with_certificate) as client:
        assert "trainer-m" in [c.id for c in (await client.status()).components]

    # Trusting the server is not enough: a client must show a certificate of the CA.
    async with open_channel(synchronizer.grpc_address, token=TEST_TOKEN, max_attempts=1, default_timeout=5,
                            tls=TlsFiles(ca_file=pki.ca_file)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await synchronizer_pb2_grpc.SynchronizerServiceStub(channel).Status(synchronizer_pb2.StatusRequest())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # /metrics: the client certificate, and with server.metrics_auth a token too.
    url = f"https://127.0.0.1:{synchronizer.info['metrics_port']}/metrics"
    mutual = ssl.create_default_context(cafile=str(pki.ca_file))
    mutual.load_cert_chain(pki.cert_file, pki.key_file)
    async with httpx.AsyncClient(verify=mutual, timeout=10) as http:
        assert (await http.get(url)).status_code == 401
        answered = await http.get(url, headers={"authorization": f"Bearer {TEST_TOKEN}"})
        assert answered.status_code == 200 and "flywheel_service_ready" in answered.text
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(pki.ca_file)), timeout=10) as http:
        # Under TLS 1.3 the refusal of a missing certificate arrives after the handshake, as the reply is read.
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            await http.get(url, headers={"authorization": f"Bearer {TEST_TOKEN}"})
