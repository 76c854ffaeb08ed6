"""A tool-using agent written against the official `openai` SDK only: what you
bring to Flywheel's external worker. Nothing here imports Flywheel.

The model gets an arithmetic question ("What is 7 * 3 + 12?") and a
`calculator` tool. Each tool call runs here and its result goes back as a
"tool" message, after the conversation so far, unchanged: the rollout then
reuses the exact tokens of the earlier turns, so what is trained is what was
sampled. The first call must use the tool (`tool_choice="required"`), the
last one may not (`"none"`): the episode ends with an answer, at the latest
after MAX_TURNS model calls. The reward: 1.0 when a number in the final
answer equals the task's answer, else 0.0.

Flywheel calls `run(task, base_url, api_key)` once per episode, with the base
URL and key of a session that records every call. On its own, against any
OpenAI-compatible server (a rollout service's HTTP port, for instance):

    python examples/agent/calculator_agent.py --base-url http://127.0.0.1:8000/v1 "What is 7 * 3 + 12?" 33
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re

from openai import AsyncOpenAI

MAX_TURNS = 3
#: 0.7: at 1.0 SmolLM2-135M's turns lose the thread (tool JSON with prose in it, code instead of answers).
TEMPERATURE = 0.7
SYSTEM = "You are a careful assistant. Use the calculator tool for each step, then state the final result."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 7 * 3"}},
            "required": ["expression"],
        },
    },
}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg}


def evaluate(node: ast.AST) -> float:
    """Arithmetic only: no names, no calls (the model writes the expression)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(arguments: str) -> str:
    """The tool: its result, or the error the model should see."""
    try:
        value = evaluate(ast.parse(json.loads(arguments)["expression"], mode="eval").body)
    except Exception as exc:  # a malformed call is the model's mistake: tell it, do not crash
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


def reward(final_answer: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", final_answer.replace(",", ""))
    return 1.0 if str(answer).strip() in numbers else 0.0


async def run(task: dict, base_url: str, api_key: str) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        model = (await client.models.list()).data[0].id
        messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
        for turn in range(MAX_TURNS):
            # Left to itself a small model rarely calls a tool, or calls it forever and never answers.
            tool_choice = "required" if turn == 0 else "none" if turn == MAX_TURNS - 1 else "auto"
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                temperature=TEMPERATURE, max_tokens=128,
            )
            message = response.choices[0].message
            messages.append(message)  # the assistant turn exactly as it came back
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
        return reward(message.content or "", task["answer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("answer")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args()
    task = {"id": "cli", "prompt": args.question, "answer": args.answer, "data": {}}
    print("reward:", asyncio.run(run(task, args.base_url, args.api_key)))


if __name__ == "__main__":
    main()
