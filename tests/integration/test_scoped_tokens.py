"""Scoped tokens through real processes: an agent token generates and tokenizes (gRPC and
HTTP) and nothing else; a service token is what the services call each other with; the
operator token may call everything; a refusal names the scope needed; no token is logged."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from flywheel.common.v1 import common_pb2
from flywheel.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.client import SynchronizerClient
from tests.conftest import TEST_TOKEN
from tests.integration.test_services_start import DESCRIPTORS

VIEWER, AGENT, SERVICE, OPERATOR = "viewer-token-v1", "agent-token-a1", "service-token-s1", "operator-token-o1"


@pytest.fixture
def scoped_env(tmp_path: Path, service_env: dict[str, str]) -> dict[str, str]:
    """Children with a tokens file of every scope; the single token of earlier releases stays (operator)."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"viewer: {VIEWER}\nagent: [{AGENT}, agent-token-a2]\nservice: {SERVICE}\noperator: {OPERATOR}\n")
    return {**service_env, "FLYWHEEL_TOKENS_FILE": str(tokens)}


async def _code_and_details(address: str, token: str, service: str, method: str) -> tuple[grpc.StatusCode, str]:
    """Calls `method` of `service` with an empty request; its status code and details."""
    async with open_channel(address, token=token, max_attempts=1) as channel:
        descriptor = DESCRIPTORS[service].methods_by_name[method]
        path = f"/{DESCRIPTORS[service].full_name}/{method}"
        try:
            if descriptor.server_streaming:
                async for _ in channel.unary_stream(path)(b"", timeout=10):
                    pass
            else:
                await channel.unary_unary(path)(b"", timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_rollout_scopes_over_grpc_and_http(run_service, scoped_env: dict[str, str]) -> None:
    child = run_service("rollout", env=scoped_env)
    address = child.grpc_address

    # The agent generates and tokenizes over gRPC...
    async with open_channel(address, token="agent-token-a2", max_attempts=1) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        tokens = await stub.Tokenize(rollout_pb2.TokenizeRequest(text="hello"), timeout=30)
        assert tokens.token_ids
        generated = await stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=list(tokens.token_ids)))],
            sampling=common_pb2.SamplingParams(max_tokens=4),
        ), timeout=60)
        assert generated.results[0].samples
    # ...and nothing else: each refusal names the scope needed and the scope held.
    for method in ("UpdateWeights", "GetStatus", "Pause", "Resume"):
        code, details = await _code_and_details(address, AGENT, "rollout", method)
        assert code == grpc.StatusCode.PERMISSION_DENIED, method
        assert details == f"{method} needs scope service or operator; this token has scope agent"
    # A service token may (an empty UpdateWeights is refused by the service itself, not by auth).
    assert (await _code_and_details(address, SERVICE, "rollout", "GetStatus"))[0] == grpc.StatusCode.OK
    assert (await _code_and_details(address, SERVICE, "rollout", "UpdateWeights"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (await _code_and_details(address, OPERATOR, "rollout", "GetStatus"))[0] == grpc.StatusCode.OK
    assert (await _code_and_details(address, "nobody", "rollout", "Generate"))[0] == grpc.StatusCode.UNAUTHENTICATED

    # The OpenAI-compatible API is the agent's.
    http_port = _http_port(child)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
        body = {"prompt": "hello", "max_tokens": 4}
        ok = await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {AGENT}"})
        assert ok.status_code == 200, ok.text
        opened = await http.post("/v1/sessions", json={}, headers={"authorization": f"Bearer {AGENT}"})
        assert opened.status_code == 200, opened.text
        refused = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer nobody"})
        assert refused.status_code == 401

    log = child.log_path.read_text()
    for token in (AGENT, "agent-token-a2", SERVICE, OPERATOR, TEST_TOKEN):
        assert token not in log


def _http_port(child) -> int:
    import json

    from flywheel.runtime.http_server import http_ready_file

    return json.loads(http_ready_file(child.ready_path).read_text())["http_port"]


async def test_service_token_links_services_and_operator_owns_the_controller(
    run_service, scoped_env: dict[str, str]
) -> None:
    # Only scoped tokens here: the trainer registers with the synchronizer using its service token.
    env = {k: v for k, v in scoped_env.items() if k != "FLYWHEEL_AUTH_TOKEN"}
    synchronizer = run_service("synchronizer", env=env)
    trainer = run_service("trainer", "--sync.synchronizer-address", synchronizer.grpc_address,
                          "--sync.trainer-id", "trainer-scoped", env=env)
    async with SynchronizerClient(synchronizer.grpc_address, SERVICE, timeout=10) as client:
        components = [c.id for c in (await client.status()).components]
    assert "trainer-scoped" in components
    # Rewinding the run's weights is for services (the controller) and operators, not agents.
    code, details = await _code_and_details(synchronizer.grpc_address, AGENT, "synchronizer", "Rewind")
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED, "Rewind needs scope service or operator; this token has scope agent")
    code, details = await _code_and_details(synchronizer.grpc_address, SERVICE, "synchronizer", "Rewind")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "to_version must be >= 1" in details  # an unset field never starts over

    # The trainer is for services: an agent may not checkpoint it.
    code, details = await _code_and_details(trainer.grpc_address, AGENT, "trainer", "SaveCheckpoint")
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED, "SaveCheckpoint needs scope service or operator; this token has scope agent")

    # Runs are started and stopped by operators, not by services.
    controller = run_service("controller", env=env)
    code, details = await _code_and_details(controller.grpc_address, SERVICE, "controller", "Stop")
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED, "Stop needs scope operator; this token has scope service")
    code, _ = await _code_and_details(controller.grpc_address, OPERATOR, "controller", "Stop")
    assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
    # A viewer token (the status page's) reads the run over gRPC too, and changes nothing.
    code, _ = await _code_and_details(controller.grpc_address, VIEWER, "controller", "Status")
    assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
    code, details = await _code_and_details(controller.grpc_address, VIEWER, "controller", "Stop")
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED, "Stop needs scope operator; this token has scope viewer")
