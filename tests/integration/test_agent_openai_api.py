"""What agent code meets, through the official `openai` SDK and the OpenAI
Agents SDK, against a real rollout process serving the tiny model on vLLM
(CPU): forced tool calls, strict structured output, the Responses API, and
sessions whose records are the ids the client was given.

The tiny model's weights are random: it never calls a tool by itself, so
auto tool calls are covered on a scripted engine (tests/unit/rollout);
here every structure comes from the engine's constraint, which is what must
work on a real engine.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from flywheel.launcher.processes import start_service
from flywheel.models.tiny import build_tiny_model
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from flywheel.runtime.client import open_channel
from tests.conftest import TEST_TOKEN
from tests.unit.rollout.rollout_helpers import engine_args, need_engine

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates arithmetic",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["op", "exact"],
                   "properties": {"op": {"enum": ["add", "mul"]}, "exact": {"type": "boolean"}}},
}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["unit", "sure"],
          "properties": {"unit": {"enum": ["m", "s", "kg"]}, "sure": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "What is 2 times 3?"}]
# The template lists the tools in the prompt: room for them and a few turns.
ARGS = {**engine_args("vllm"), "max_model_len": 1024}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    need_engine("vllm")
    return build_tiny_model(tmp_path_factory.mktemp("agent-api") / "model")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    child = start_service("rollout", tmp_path_factory.mktemp("agent-api-rollout"), [
        "--engine.model-path", str(model), "--engine.kind", "vllm", "--engine.args", json.dumps(ARGS),
        "--http-port", "0", "--server.shutdown-grace-seconds", "2",
    ], env)
    try:
        child.wait_ready(300)
        yield f"http://127.0.0.1:{_http_port(child.grpc_address)}"
    finally:
        child.stop()


def _http_port(address: str) -> int:
    import asyncio

    async def ask() -> int:
        async with open_channel(address, token=TEST_TOKEN) as channel:
            return (await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest())).http_port

    return asyncio.run(ask())


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=TEST_TOKEN, timeout=120)


def _valid(value: dict, schema: dict) -> bool:
    props = schema["properties"]
    return set(value) == set(schema["required"]) and all(
        value[k] in p["enum"] if "enum" in p else isinstance(value[k], bool) for k, p in props.items())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calculator"}}])
def test_a_forced_tool_call_is_parsed_with_arguments_valid_for_the_tool(client, choice) -> None:
    r = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=0, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "calculator" and call.id.startswith("call_")
    assert _valid(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_a_streamed_forced_tool_call_arrives_as_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200, stream=True)
    chunks = list(stream)
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])] if chunks else []
    assert [c.function.name for c in calls] == ["calculator"]
    assert _valid(json.loads(calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_strict_json_schema_output_validates(client) -> None:
    r = client.chat.completions.create(
        model="model", messages=ASK, temperature=1.0, seed=3, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "unit", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    assert _valid(json.loads(r.choices[0].message.content), SCHEMA)


def test_responses_text_and_function_calls_streamed_and_not(client) -> None:
    text = client.responses.create(model="model", input="Say hello.", max_output_tokens=8, temperature=0)
    assert text.status in ("completed", "incomplete") and text.output[0].type == "message"
    assert text.output_text == text.output[0].content[0].text and text.usage.output_tokens > 0
    tool = {"type": "function", "name": "calculator", "parameters": TOOLS[0]["function"]["parameters"], "strict": True}
    called = client.responses.create(model="model", input="2 times 3?", tools=[tool], tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "calculator" and _valid(json.loads(call.arguments), tool["parameters"])
    with client.responses.stream(model="model", input="2 times 3?", tools=[tool], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_output_tokens=200) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == call.arguments  # greedy: the same call either way


def test_session_records_are_the_ids_the_client_got(base_url: str, model) -> None:
    manage = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {TEST_TOKEN}"}, timeout=60)
    opened = manage.post("/v1/sessions", json={}).json()
    agent = openai.OpenAI(base_url=f"{base_url}{opened['base_path']}", api_key=opened["key"], timeout=120)
    first = agent.chat.completions.create(model="model", messages=ASK, temperature=1.0, seed=1, max_tokens=12)
    answer = first.choices[0].message.content
    history = [*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    second = agent.chat.completions.create(model="model", messages=history, temperature=1.0, seed=2, max_tokens=12)
    calls = manage.get(f"/v1/sessions/{opened['id']}").json()["calls"]
    for call, got in zip(calls, (first, second)):
        extra = got.model_extra
        assert call["prompt_token_ids"] == extra["prompt_token_ids"]
        assert call["completion_token_ids"] == got.choices[0].model_extra["token_ids"]
    ids = calls[0]["completion_token_ids"]
    # The case that matters: re-tokenizing the answer's text does not give the sampled ids back (a
    # random model's ids rarely do), and the second prompt still holds them exactly.
    from transformers import AutoTokenizer

    retokenized = AutoTokenizer.from_pretrained(str(model)).encode(answer, add_special_tokens=False)
    assert first.choices[0].finish_reason == "length"  # no end token among the ids: only the text differs
    assert retokenized != ids, (answer, ids)
    assert calls[1]["prompt_token_ids"][: len(calls[0]["prompt_token_ids"]) + len(ids)] == calls[0]["prompt_token_ids"] + ids
    manage.delete(f"/v1/sessions/{opened['id']}")


def test_an_agents_sdk_agent_runs_on_the_responses_api(base_url: str) -> None:
    import agents  # the OpenAI Agents SDK, a dev dependency
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=TEST_TOKEN, timeout=120)
    calls = []

    @agents.function_tool
    def calculator(op: str, exact: bool) -> str:
        """Evaluates arithmetic."""
        calls.append(op)
        return "6"

    agent = agents.Agent(
        name="calc", instructions="Use the calculator.", tools=[calculator],
        model=agents.OpenAIResponsesModel(model="model", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is 2 times 3?", max_turns=3)
    assert calls and result.final_output == "6"
