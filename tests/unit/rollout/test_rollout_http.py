"""The OpenAI-compatible HTTP layer on a fake engine: auth, errors, 429, SSE framing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.rollout.config import RolloutConfig
from services.rollout.serving.core import RolloutCore
from flywheel.runtime.auth import Scope, TokenScopes
from services.rollout.openai_api.http_api import create_app
from services.rollout.openai_api.sessions import SessionStore
from tests.unit.rollout.fake_engine import FakeEngine

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def core(codec) -> RolloutCore:
    config = RolloutConfig.model_validate({"limits": {"max_pending_requests": 2, "retry_after_seconds": 3}})
    return RolloutCore(config, engine=FakeEngine(step_seconds=0.002), codec=codec, model_name="tiny")


@pytest.fixture
def client(core: RolloutCore) -> httpx.AsyncClient:
    app = create_app(core, core.config, TokenScopes.of({Scope.OPERATOR: [TOKEN]}), SessionStore(default_ttl_seconds=60, max_open=4), "rollout-test")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout")


async def test_auth_is_required_except_for_health_and_metrics(client) -> None:
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
    models = (await client.get("/v1/models", headers=AUTH)).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["weight_version"] == 0
    assert (await client.get("/health")).json()["status"] == "ok"
    assert "flywheel_rollout_weight_version" in (await client.get("/metrics")).text


async def test_completion_carries_ids_and_versions(client) -> None:
    r = await client.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200, body
    assert body["prompt_token_ids"] == [5, 6, 7] and body["weight_version"] == {"start": 0, "end": 0}
    (choice,) = body["choices"]
    assert choice["token_ids"] == [100, 100, 100] and choice["finish_reason"] == "length"
    # The version of each token, as [version, start, end] spans over token_ids.
    assert choice["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0, 3]]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


@pytest.mark.parametrize(
    ("path", "payload", "status", "starts"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens:"),
        ("/v1/completions", {"prompt": "hi", "temperatur": 1}, 400, "temperatur: unknown parameter"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt: empty prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt: empty prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo: not supported"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt[1]: token id 99999"),
        ("/v1/completions", {"prompt": list(range(1, 600))}, 400, "prompt: the prompt is"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model:"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content:"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role:"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages:"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs:"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(client, path: str, payload: dict, status: int, starts: str) -> None:
    r = await client.post(path, headers=AUTH, json=payload)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"].startswith(starts), r.json()


async def test_invalid_utf8_and_json_bodies_are_400(client) -> None:
    r = await client.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content=b'{"prompt": "caf\xe9"}')
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content=b'{"prompt": "\\ud800"}')
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: not valid UTF-8")
    r = await client.post("/v1/completions", headers=AUTH, content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


async def test_full_queue_is_429_with_retry_after(client) -> None:
    slow = [asyncio.create_task(client.post("/v1/completions", headers=AUTH, json={"prompt": [1], "max_tokens": 50}))
            for _ in range(2)]
    await asyncio.sleep(0.02)
    r = await client.post("/v1/completions", headers=AUTH, json={"prompt": [1], "max_tokens": 1})
    # retry_after_seconds 3, spread over [3, 6] s so refused clients do not all come back at once
    assert r.status_code == 429 and 3 <= int(r.headers["Retry-After"]) <= 6
    assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
    assert (await client.post("/v1/completions", headers=AUTH, json={"prompt": [1], "max_tokens": 1})).status_code == 200


async def test_streams_are_sse_with_a_final_version_and_done(client) -> None:
    r = await client.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["prompt_token_ids"]
    tokens = sum((c["choices"][0]["token_ids"] for c in chunks[1:] if c["choices"]), [])
    assert tokens == [100, 100, 100]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[0]["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0, 3]]}
    assert chunks[-1]["usage"]["completion_tokens"] == 3


TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL_TEXT = 'Sure.<tool_call>\n{"name": "calc", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


async def test_tool_calls_in_the_answer_become_openai_tool_calls(client, core) -> None:
    core.engine.reply = CALL_TEXT
    body = {"messages": [{"role": "user", "content": "6 * 7?"}], "tools": TOOLS, "max_tokens": 100}
    r = (await client.post("/v1/chat/completions", headers=AUTH, json=body)).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "calc", "arguments": '{"expression": "6 * 7"}'}
    # Without tools in the request the same text is plain content.
    plain = (await client.post("/v1/chat/completions", headers=AUTH, json={**body, "tools": None})).json()
    assert plain["choices"][0]["message"]["content"] == CALL_TEXT and plain["choices"][0]["finish_reason"] == "stop"

    r = await client.post("/v1/chat/completions", headers=AUTH, json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "Sure." and [tc["function"]["name"] for tc in calls] == ["calc"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
