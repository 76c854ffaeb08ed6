"""The Anthropic Messages dialect (`/v1/messages`) through the official
`anthropic` SDK: on the tiny model with the transformers engine (text,
streaming, a tool-use conversation, Flywheel's ids and versions, errors in
that API's shape), and on a scripted engine for what a random tiny model
never writes by itself (tool calls in its answer, sessions continuing
token-exact)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest
import pytest_asyncio

try:  # the SDK's HTTP client: httpx2 from anthropic 2.x on, httpx before
    import httpx2 as sdk_http
except ImportError:
    sdk_http = httpx

from flywheel.runtime.auth import Scope, TokenScopes
from services.rollout.config import RolloutConfig
from services.rollout.engine.transformers_engine import TransformersEngine
from services.rollout.openai_api.http_api import create_app
from services.rollout.openai_api.sessions import SessionStore
from services.rollout.serving.core import RolloutCore
from tests.unit.rollout.fake_engine import FakeEngine
from tests.unit.rollout.rollout_helpers import reference_greedy

TOKEN = "secret"
TOOLS = [{"name": "calc", "description": "evaluates arithmetic",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
CALL_TEXT = 'Sure.<tool_call>\n{"name": "calc", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is 6 * 7?"}]
#: The Messages API's sampling parameters, which its SDK no longer names (sent as extra body fields).
GREEDY = {"temperature": 0}


def _app(core: RolloutCore, sessions: SessionStore | None = None):
    return create_app(core, core.config, TokenScopes.of({Scope.OPERATOR: [TOKEN]}),
                      sessions or SessionStore(default_ttl_seconds=60, max_open=4), "rollout-a")


def _sdk(app, key: str = TOKEN, base: str = "http://rollout") -> anthropic.AsyncAnthropic:
    transport = sdk_http.ASGITransport(app=app)  # requests go into the app in-process
    return anthropic.AsyncAnthropic(api_key=key, base_url=base, max_retries=0,
                                    http_client=sdk_http.AsyncClient(transport=transport, base_url=base))


@pytest_asyncio.fixture
async def tiny(rollout_model: Path, codec):
    engine = TransformersEngine(rollout_model, {"dtype": "float32", "max_model_len": 1024, "seed": 0}, codec)
    await engine.start()
    core = RolloutCore(RolloutConfig(), engine=engine, codec=codec, model_name="tiny")
    yield core
    await engine.stop()


async def test_messages_and_streams_on_the_tiny_model_carry_its_greedy_tokens(tiny, rollout_model: Path) -> None:
    client = _sdk(_app(tiny))
    message = await client.messages.create(model="tiny", max_tokens=6, messages=ASK, extra_body=GREEDY,
                                           system="You add numbers.")
    extra = message.model_extra or {}
    assert message.type == "message" and message.role == "assistant" and message.stop_reason in ("max_tokens", "end_turn")
    assert extra["token_ids"] == reference_greedy(rollout_model, extra["prompt_token_ids"], len(extra["token_ids"]))
    assert extra["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0, len(extra["token_ids"])]]}
    assert message.usage.input_tokens == len(extra["prompt_token_ids"]) and message.usage.output_tokens == len(extra["token_ids"])
    assert message.content[0].type == "text" and message.content[0].text == tiny.codec.decode(extra["token_ids"])

    async with client.messages.stream(model="tiny", max_tokens=6, messages=ASK, extra_body=GREEDY,
                                      system="You add numbers.") as stream:
        texts = [text async for text in stream.text_stream]
        streamed = await stream.get_final_message()
    assert "".join(texts) == message.content[0].text == streamed.content[0].text
    assert streamed.stop_reason == message.stop_reason and streamed.usage.output_tokens == len(extra["token_ids"])

    # A tool-use conversation: the tools are shown to the model, the earlier call and its result rendered.
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expression": "6 * 7"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]
    counted = await client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    answer = await client.messages.create(model="tiny", max_tokens=3, messages=history, tools=TOOLS, extra_body=GREEDY)
    prompt = tiny.codec.decode((answer.model_extra or {})["prompt_token_ids"], skip_special_tokens=False)
    assert '"calc"' in prompt and "6 * 7" in prompt and "42" in prompt
    assert counted.input_tokens == answer.usage.input_tokens


async def test_bad_requests_get_the_messages_error_shape(tiny) -> None:
    client = _sdk(_app(tiny))
    cases = [
        ({"max_tokens": 4, "messages": ASK, "model": "other"}, anthropic.NotFoundError, "not_found_error", "model:"),
        ({"max_tokens": 0, "messages": ASK, "model": "tiny"}, anthropic.BadRequestError, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "model": "tiny"},
         anthropic.BadRequestError, "invalid_request_error", "messages[0].content[0].type: 'image'"),
        ({"max_tokens": 4, "messages": ASK, "model": "tiny", "tools": [{"type": "web_search_20250305", "name": "w"}]},
         anthropic.BadRequestError, "invalid_request_error", "tools[0].type"),
        ({"max_tokens": 4, "messages": ASK, "model": "tiny", "thinking": {"type": "enabled", "budget_tokens": 1024}},
         anthropic.BadRequestError, "invalid_request_error", "thinking: not supported"),
    ]
    for body, error, kind, starts in cases:
        with pytest.raises(error) as info:
            await client.messages.create(**body)
        assert info.value.body == {"type": "error", "error": {"type": kind, "message": info.value.body["error"]["message"]}}
        assert info.value.body["error"]["message"].startswith(starts), info.value.body
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="tiny", max_tokens=4, messages=ASK, extra_body={"frequency_penalty": 1})
    assert info.value.body["error"]["message"] == "frequency_penalty: unknown parameter"
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await _sdk(_app(tiny), key="wrong").messages.create(model="tiny", max_tokens=4, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"


@pytest.fixture
def scripted(codec) -> RolloutCore:
    return RolloutCore(RolloutConfig(), engine=FakeEngine(step_seconds=0.0005), codec=codec, model_name="tiny")


async def test_tool_calls_in_the_answer_become_tool_use_blocks_streamed_and_not(scripted) -> None:
    scripted.engine.reply = CALL_TEXT
    client = _sdk(_app(scripted))
    message = await client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)
    text, call = message.content
    assert message.stop_reason == "tool_use" and text.text == "Sure."
    assert call.type == "tool_use" and call.name == "calc" and call.input == {"expression": "6 * 7"}
    assert call.id.startswith("toolu_")

    async with client.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        deltas = [event async for event in stream]
        streamed = await stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use"] and streamed.stop_reason == "tool_use"
    assert streamed.content[0].text == "Sure." and streamed.content[1].input == {"expression": "6 * 7"}
    assert "<tool_call>" not in "".join(e.delta.text for e in deltas
                                        if e.type == "content_block_delta" and e.delta.type == "text_delta")
    ends = [e for e in deltas if e.type == "message_delta"]
    assert len(ends) == 1 and len((ends[0].model_extra or {})["token_ids"]) == len(CALL_TEXT)


async def test_a_session_records_messages_and_continues_token_exact(scripted) -> None:
    sessions = SessionStore(default_ttl_seconds=60, max_open=4)
    app = _app(scripted, sessions)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout") as http:
        opened = (await http.post("/v1/sessions", headers=auth)).json()
        client = _sdk(app, key=opened["key"], base=f"http://rollout/sessions/{opened['id']}")
        scripted.engine.reply = CALL_TEXT
        first = await client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)
        scripted.engine.reply = "It is 42."
        reply = [{"type": block.type, **({"text": block.text} if block.type == "text" else
                                         {"id": block.id, "name": block.name, "input": block.input})}
                 for block in first.content]
        second = await client.messages.create(model="tiny", max_tokens=200, tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "content": reply},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id, "content": "42"}]}])
        record = (await http.get(f"/v1/sessions/{opened['id']}", headers=auth)).json()
    calls = record["calls"]
    assert [c["api"] for c in calls] == ["messages", "messages"] and calls[0]["replica"] == "rollout-a"
    one, two = ((m.model_extra or {}) for m in (first, second))
    assert calls[0]["completion_token_ids"] == one["token_ids"] and calls[1]["prompt_token_ids"] == two["prompt_token_ids"]
    # The second prompt extends the first turn's own ids: the trajectory is what was sampled.
    assert two["prompt_token_ids"][:len(one["prompt_token_ids"]) + len(one["token_ids"])] == \
        one["prompt_token_ids"] + one["token_ids"]
    with pytest.raises(anthropic.AuthenticationError):
        await _sdk(app, key=TOKEN, base=f"http://rollout/sessions/{opened['id']}").messages.create(
            model="tiny", max_tokens=4, messages=ASK)


def test_a_stream_that_fails_midway_ends_with_an_error_event() -> None:
    from services.rollout.openai_api.http_messages import MessageEvents
    from flywheel.errors import Unavailable

    (event,) = MessageEvents("msg_1", "tiny", None).error(Unavailable("quarantined"))
    assert event.startswith("event: error\n")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "quarantined"}}
