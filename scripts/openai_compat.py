"""What agent code asks of an OpenAI-compatible server, checked side by side:
Flywheel's rollout service and vLLM's own OpenAI server, on the same model,
started the same way (vLLM engine, same engine arguments), one after the other.

    .venv/bin/python scripts/openai_compat.py [--model DIR]   # default: the quickstart's SmolLM2

Each check goes through the official `openai` SDK and passes when the answer
has the promised shape (a parsed tool call whose arguments validate against
the tool's schema, JSON that validates against the schema asked for, the
Responses event sequence...). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import jsonschema
import openai

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 8,
               "kv_cache_memory_bytes": 256 * 2**20, "enforce_eager": True, "seed": 0}
CALCULATOR = {"type": "object", "additionalProperties": False, "required": ["expression"],
              "properties": {"expression": {"type": "string", "maxLength": 40}}}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates an arithmetic expression.",
                                           "parameters": CALCULATOR}}]
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "confident"],
          "properties": {"answer": {"type": "integer"}, "confident": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]
MAX = {"max_tokens": 120, "temperature": 0}


def _call_ok(name: str, arguments: str) -> str:
    jsonschema.validate(json.loads(arguments), CALCULATOR)
    assert name == "calculator", name
    return f"calculator({arguments})"


def checks(client: openai.OpenAI, model: str) -> dict[str, Callable[[], str]]:
    def chat() -> str:
        r = client.chat.completions.create(model=model, messages=ASK, **MAX)
        assert r.choices[0].message.content, "no content"
        return repr(r.choices[0].message.content[:40])

    def chat_stream() -> str:
        chunks = list(client.chat.completions.create(model=model, messages=ASK, stream=True, **MAX))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and any(c.choices and c.choices[0].finish_reason for c in chunks), "no text or no finish"
        return f"{len(chunks)} chunks"

    def tool(choice: object) -> Callable[[], str]:
        def run() -> str:
            r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, **MAX)
            calls = r.choices[0].message.tool_calls
            assert calls, f"no tool call: {r.choices[0].message.content!r}"
            return _call_ok(calls[0].function.name, calls[0].function.arguments)
        return run

    def tool_auto() -> str:
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", **MAX)
        calls = r.choices[0].message.tool_calls
        if calls:
            return "called " + _call_ok(calls[0].function.name, calls[0].function.arguments)
        assert r.choices[0].message.content, "neither a call nor text"
        return "answered in text"

    def tool_stream() -> str:
        chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                     stream=True, **MAX))
        names, arguments = "", ""
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                names += d.function.name or "" if d.function else ""
                arguments += d.function.arguments or "" if d.function else ""
        return _call_ok(names, arguments)

    def schema() -> str:
        r = client.chat.completions.create(model=model, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}, **MAX)
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
        return r.choices[0].message.content

    def json_object() -> str:
        r = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"}, **MAX)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        return r.choices[0].message.content[:40]

    def responses() -> str:
        r = client.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=120, temperature=0)
        assert r.output_text, "no output_text"
        return repr(r.output_text[:40])

    def responses_stream() -> str:
        with client.responses.stream(model=model, input=ASK[0]["content"], max_output_tokens=120,
                                     temperature=0) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert final.output_text, "no text"
        return f"{len(kinds)} events"

    def responses_tool() -> str:
        tool = {"type": "function", "name": "calculator", "parameters": CALCULATOR, "strict": True}
        r = client.responses.create(model=model, input=ASK[0]["content"], tools=[tool], tool_choice="required",
                                    max_output_tokens=120, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls, "no function_call item"
        return _call_ok(calls[0].name, calls[0].arguments)

    return {
        "chat": chat, "chat streaming": chat_stream, "tool_choice named": tool(
            {"type": "function", "function": {"name": "calculator"}}),
        "tool_choice required": tool("required"), "tool_choice auto": tool_auto,
        "tool call streamed": tool_stream, "json_schema strict": schema, "json_object": json_object,
        "responses": responses, "responses streaming": responses_stream, "responses function call": responses_tool,
    }


def run_checks(base_url: str, key: str, model: str) -> dict[str, tuple[bool, str]]:
    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=300, max_retries=0)
    results = {}
    for name, check in checks(client, model).items():
        try:
            results[name] = (True, check())
        except Exception as exc:  # noqa: BLE001 - a failed check is a result
            results[name] = (False, f"{type(exc).__name__}: {str(exc)[:90]}")
    return results


def _wait(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def serve_and_check(command: list[str], health: str, base_url: str, key: str, model: str,
                    log: Path) -> dict[str, tuple[bool, str]]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "FLYWHEEL_AUTH_TOKEN": key}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait(health, process)
        return run_checks(base_url, key, model)
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/flywheel/models/smollm2-135m-instruct")
    parser.add_argument("--port", type=int, default=18300)
    args = parser.parse_args()
    model, port, logs = args.model, args.port, Path(tempfile.mkdtemp(prefix="openai-compat-"))
    ours = serve_and_check(
        [sys.executable, "-m", "services.rollout", "--engine.model-path", str(model), "--engine.kind", "vllm",
         "--engine.args", json.dumps(ENGINE_ARGS), "--engine.served-model-name", "model", "--http-port", str(port),
         "--server.port", str(port + 1), "--server.metrics-port", "0"],
        f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1", "compat-key", "model", logs / "flywheel.log")
    engine_flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in ENGINE_ARGS.items()]
    theirs = serve_and_check(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
         "model", "--port", str(port), "--api-key", "compat-key", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", *engine_flags],
        f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1", "compat-key", "model", logs / "vllm.log")
    print(f"{'check':26} {'flywheel':9} {'vllm':9} flywheel detail | vllm detail")
    for name in ours:
        (a, da), (b, db) = ours[name], theirs[name]
        print(f"{name:26} {'pass' if a else 'FAIL':9} {'pass' if b else 'FAIL':9} {da[:60]} | {db[:60]}")
    print(f"logs: {logs}")
    print(json.dumps({"flywheel_passed": sum(ok for ok, _ in ours.values()),
                      "vllm_passed": sum(ok for ok, _ in theirs.values()), "checks": len(ours)}))


if __name__ == "__main__":
    main()
