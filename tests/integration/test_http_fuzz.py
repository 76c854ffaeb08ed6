"""The rollout's OpenAI-compatible HTTP API driven by schemathesis from the
OpenAPI document it serves (`GET /openapi.json`), against a real rollout
process serving the tiny model on vLLM (CPU): for every operation, requests
the document allows (positive) and requests it forbids (negative: wrong
types, unknown fields, missing required ones, out-of-range values).

Whatever arrives, the answer is never a 5xx; its status is one the document
lists, its body matches the document (errors OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`), a request the document
forbids is refused with a 4xx, and the server stays up and healthy. The
HTTP analogue of tests/integration/test_fuzz_rpcs.py.

Cases per operation and mode: FLYWHEEL_FUZZ_CASES (CI runs the default; the
full-length run sets more).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from flywheel.launcher.processes import ServiceProcess, start_service
from flywheel.models.tiny import build_tiny_model
from tests.conftest import TEST_TOKEN
from tests.integration.test_agent_openai_api import _http_port
from tests.unit.rollout.rollout_helpers import engine_args, need_engine

import schemathesis  # noqa: E402  (a dev dependency: missing, the test fails rather than skips)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, negative_data_rejection, response_headers_conformance, response_schema_conformance,
    status_code_conformance,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CASES = int(os.environ.get("FLYWHEEL_FUZZ_CASES", "12"))
#: Every request's deadline. Generous: a valid request may ask for many samples of up to max_model_len
#: tokens each, and the admission limit lets a few such run at once (a full-length run on a loaded
#: 2-core machine once waited more than 60 s for a request queued behind them).
CALL_DEADLINE = 180.0
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
#: A small admission limit: a request asking for many samples is refused (429) instead of keeping the engine busy.
MAX_PENDING = 8
#: A short context bounds what one request can make the engine do.
ARGS = {**engine_args("vllm"), "max_model_len": 256}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, str]]:
    need_engine("vllm")
    model = build_tiny_model(tmp_path_factory.mktemp("http-fuzz") / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | {"FLYWHEEL_AUTH_TOKEN": TEST_TOKEN}
    child = start_service("rollout", tmp_path_factory.mktemp("http-fuzz-rollout"), [
        "--engine.model-path", str(model), "--engine.kind", "vllm", "--engine.args", json.dumps(ARGS),
        "--http-port", "0", "--limits.max-pending-requests", str(MAX_PENDING), "--server.shutdown-grace-seconds", "2",
    ], env)
    try:
        child.wait_ready(300)
        yield child, f"http://127.0.0.1:{_http_port(child.grpc_address)}"
    finally:
        child.stop()


def _session(base_url: str) -> tuple[str, str]:
    r = httpx.post(f"{base_url}/v1/sessions", headers={"Authorization": f"Bearer {TEST_TOKEN}"}, timeout=30)
    r.raise_for_status()
    return r.json()["id"], r.json()["key"]


def _case(child: ServiceProcess, base_url: str, headers: dict[str, str], statuses: Counter
          ) -> Callable[[schemathesis.Case], None]:
    """One case: sent with `headers` (the bearer token), its status counted, its answer checked."""

    def case(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=CALL_DEADLINE)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS, headers=headers)
        assert child.process.poll() is None, f"the rollout died on {case.as_curl_command(headers)}"

    return case


def test_random_requests_to_every_route_get_a_documented_answer_never_a_5xx(
    rollout: tuple[ServiceProcess, str]
) -> None:
    child, base_url = rollout
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/responses",
                                              "/v1/models", "/v1/sessions", "/health"}
    # Session-scoped routes are fuzzed within a real session (a random id only meets the key check).
    session_id, session_key = _session(base_url)
    seen: dict[str, Counter] = {}
    for op in operations:
        scoped = "{session_id}" in op.path
        headers = {"Authorization": f"Bearer {session_key if scoped else TEST_TOKEN}"}
        # Only a body can be sent invalid: the parameters are strings, a session's id is fixed.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if len(op.body) else (GenerationMode.POSITIVE,)
        for mode in modes:
            strategy = op.as_strategy(generation_mode=mode, path_parameters={"session_id": session_id} if scoped else None)
            statuses = seen.setdefault(f"{op.label} {mode.value}", Counter())

            settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))(given(strategy)(_case(child, base_url, headers, statuses)))()
    health = httpx.get(f"{base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    print({label: dict(sorted(counts.items())) for label, counts in seen.items()})
    print("cases:", sum(sum(c.values()) for c in seen.values()))
