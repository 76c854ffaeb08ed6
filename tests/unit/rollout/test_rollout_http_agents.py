"""What external agents meet over HTTP, on a fake engine: sessions (keys,
records, finish, delete, loss), the Responses API's shapes and events, and
the 4xx an engine that cannot constrain output answers."""

from __future__ import annotations

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
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(step_seconds=0.001)


@pytest.fixture
def core(codec, engine) -> RolloutCore:
    return RolloutCore(RolloutConfig(), engine=engine, codec=codec, model_name="tiny")


@pytest.fixture
def client(core) -> httpx.AsyncClient:
    app = create_app(core, core.config, TokenScopes.of({Scope.OPERATOR: [TOKEN]}), SessionStore(default_ttl_seconds=60, max_open=4), "rollout-a")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout")


async def _open(client) -> tuple[str, dict[str, str]]:
    r = await client.post("/v1/sessions", headers=AUTH, json={"ttl_seconds": 30, "metadata": {"task": "t1"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["base_path"] == f"/sessions/{body['id']}/v1"
    return body["base_path"], {"Authorization": f"Bearer {body['key']}"}


async def test_calls_through_a_session_are_recorded_as_returned_and_finish_with_a_reward(client, engine) -> None:
    base, key = await _open(client)
    engine.reply = "hello"
    chat = (await client.post(f"{base}/chat/completions", headers=key,
                              json={"messages": [{"role": "user", "content": "hi"}]})).json()
    completion = (await client.post(f"{base}/completions", headers=key, json={"prompt": [5, 6], "max_tokens": 2})).json()
    session_id = base.split("/")[2]
    assert (await client.post(f"{base}/finish", headers=key, json={"reward": 0.5})).status_code == 200
    record = (await client.get(f"/v1/sessions/{session_id}", headers=AUTH)).json()
    assert record["state"] == "finished" and record["reward"] == 0.5 and record["metadata"] == {"task": "t1"}
    first, second = record["calls"]
    assert first["api"] == "chat.completions" and first["replica"] == "rollout-a"
    assert first["prompt_token_ids"] == chat["prompt_token_ids"]
    assert first["completion_token_ids"] == chat["choices"][0]["token_ids"]
    assert len(first["logprobs"]) == len(first["completion_token_ids"])
    assert second["prompt_token_ids"] == [5, 6] and second["completion_token_ids"] == completion["choices"][0]["token_ids"]
    assert (await client.delete(f"/v1/sessions/{session_id}", headers=AUTH)).status_code == 200
    gone = await client.get(f"/v1/sessions/{session_id}", headers=AUTH)
    assert gone.status_code == 410 and "deleted" in gone.json()["error"]["message"]


async def test_a_session_key_opens_nothing_else(client) -> None:
    base, key = await _open(client)
    other_base, other_key = await _open(client)
    assert (await client.get(f"{base}/models", headers=key)).status_code == 200
    assert (await client.get(f"{base}/models", headers=other_key)).status_code == 401
    assert (await client.get(f"{base}/models", headers=AUTH)).status_code == 401  # the service token is not a key
    assert (await client.get("/v1/models", headers=key)).status_code == 401
    assert (await client.post("/v1/sessions", headers=key)).status_code == 401
    assert (await client.get(f"/v1/sessions/{base.split('/')[2]}", headers=key)).status_code == 401


async def test_session_requests_are_checked(client) -> None:
    base, key = await _open(client)
    r = await client.post(f"{base}/chat/completions", headers=key,
                          json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("n: a session records one answer")
    r = await client.post(f"{base}/finish", headers=key, json={"reward": "high"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("reward:")
    r = await client.post("/v1/sessions", headers=AUTH, json={"ttl_seconds": -1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("ttl_seconds:")
    r = await client.get("/sessions/0123abcd-feed/v1/models", headers=key)
    assert r.status_code == 410 and "restarted" in r.json()["error"]["message"]


async def test_session_calls_are_paced_by_the_step_and_version_the_controller_named(client, core) -> None:
    waited = []

    async def gate(run_step: int, min_version: int) -> None:
        waited.append((run_step, min_version))

    core.weights_gate = gate
    opened = (await client.post("/v1/sessions", headers=AUTH, json={
        "metadata": {"run_step": "3", "min_weight_version": "2"}})).json()
    key = {"Authorization": f"Bearer {opened['key']}"}
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    await client.post(f"{opened['base_path']}/chat/completions", headers=key, json=ask)
    await client.post(f"{opened['base_path']}/chat/completions", headers=key, json={**ask, "stream": True})
    await client.post(f"{opened['base_path']}/responses", headers=key, json={"input": "hi", "max_output_tokens": 2})
    await client.post("/v1/chat/completions", headers=AUTH, json=ask)
    assert waited == [(3, 2), (3, 2), (3, 2), (0, 0)]
    r = await client.post("/v1/sessions", headers=AUTH, json={"metadata": {"run_step": "three"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("metadata.run_step:")


@pytest.mark.parametrize(("payload", "starts"), [
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice: the fake engine cannot constrain"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}, "tools": TOOLS}, "tool_choice: the fake engine"),
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}, "tools": TOOLS}, "tool_choice: names function 'mul'"),
    ({"tool_choice": "required"}, "tool_choice: \"required\" needs tools"),
    ({"response_format": {"type": "json_object"}}, "response_format: the fake engine cannot constrain"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema:"),
    ({"response_format": {"type": "yaml"}}, "response_format.type: must be text, json_object or json_schema"),
])
async def test_chat_refusals_name_the_field(client, payload, starts) -> None:
    r = await client.post("/v1/chat/completions", headers=AUTH,
                          json={"messages": [{"role": "user", "content": "hi"}], **payload})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(starts), r.json()


async def test_auto_tool_calls_are_parsed_in_chat_and_responses(client, engine) -> None:
    engine.reply = 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    chat = (await client.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS})).json()
    message = chat["choices"][0]["message"]
    assert chat["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Sure."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    response = (await client.post("/v1/responses", headers=AUTH, json={
        "input": "1+2?", "tools": [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}],
    })).json()
    assert response["object"] == "response" and response["status"] == "completed"
    text, call = response["output"]
    assert text["type"] == "message" and text["content"][0]["text"] == "Sure."
    assert call["type"] == "function_call" and call["name"] == "add" and call["call_id"].startswith("call_")
    assert response["usage"]["output_tokens"] == len(response["token_ids"])


async def test_auto_tool_calls_through_the_openai_sdk_streamed_and_not(core, engine) -> None:
    import openai

    app = create_app(core, core.config, TokenScopes.of({Scope.OPERATOR: [TOKEN]}), SessionStore(default_ttl_seconds=60, max_open=4), "rollout-a")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout")
    sdk = openai.AsyncOpenAI(base_url="http://rollout/v1", api_key=TOKEN, http_client=http)
    # Two calls in one turn, as hermes models emit parallel calls.
    engine.reply = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    ask = dict(model="tiny", messages=[{"role": "user", "content": "1+2 and 3+4?"}], tools=TOOLS, tool_choice="auto")
    plain = (await sdk.chat.completions.create(**ask)).choices[0]
    assert plain.finish_reason == "tool_calls" and not plain.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in plain.message.tool_calls]
    assert calls == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in plain.message.tool_calls}) == 2
    streamed: dict[int, dict] = {}
    finish = None
    async for chunk in await sdk.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == calls
    # With tool_choice none the same text is the answer, not parsed.
    plain = (await sdk.chat.completions.create(**{**ask, "tool_choice": "none"})).choices[0]
    assert plain.message.tool_calls is None and plain.message.content.startswith("<tool_call>")


async def test_an_agent_turns_continue_token_exact_whatever_its_tool_choice(client, engine) -> None:
    # The usual agent loop: a forced first call, then auto, then "none" to get an answer. Every turn
    # must extend the previous one's ids, or the episode splits (and only its last part trains).
    import openai

    engine.supports_constraints = True
    base, key = await _open(client)
    sdk = openai.AsyncOpenAI(base_url=f"http://rollout{base}", api_key=key["Authorization"][7:], http_client=client)
    engine.reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    messages: list = [{"role": "system", "content": "be careful"}, {"role": "user", "content": "1+2?"}]
    for choice in ("required", "auto", "none"):
        reply = await sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice)
        message = reply.choices[0].message
        messages.append(message)  # sent back as the SDK gave it
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "3"} for c in message.tool_calls or []]
        engine.reply = "It is 3." if choice == "auto" else engine.reply
    assert message.content == "It is 3." and message.tool_calls is None
    calls = (await client.get(f"/v1/sessions/{base.split('/')[2]}", headers=AUTH)).json()["calls"]
    assert len(calls) == 3
    for earlier, later in zip(calls, calls[1:]):
        context = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
        assert later["prompt_token_ids"][: len(context)] == context


async def test_a_streamed_response_sends_the_documented_events(client, engine) -> None:
    engine.reply = "Hi there"
    async with client.stream("POST", "/v1/responses", headers=AUTH, json={"input": "hello", "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hi there"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi there"


async def test_previous_response_id_resolves_within_a_session_only(client, engine) -> None:
    engine.reply = "Paris"
    plain = await client.post("/v1/responses", headers=AUTH, json={"input": "hi", "previous_response_id": "resp-x"})
    assert plain.status_code == 400 and "needs a session endpoint" in plain.json()["error"]["message"]
    base, key = await _open(client)
    first = (await client.post(f"{base}/responses", headers=key, json={"input": "Capital of France?"})).json()
    second = (await client.post(f"{base}/responses", headers=key, json={
        "input": "And of Italy?", "previous_response_id": first["id"]})).json()
    # The second prompt continues the first answer's own ids.
    assert second["prompt_token_ids"][: len(first["prompt_token_ids"]) + len(first["token_ids"])] == \
        first["prompt_token_ids"] + first["token_ids"]
    unknown = await client.post(f"{base}/responses", headers=key, json={"input": "x", "previous_response_id": "resp-nope"})
    assert unknown.status_code == 404
