"""Server-sent-event bodies of streaming completions and chat completions.

Each sample's tokens go out as they come, with Flywheel's `token_ids` on
every chunk; a sample's last chunk has its `finish_reason` and
`weight_version`. With tools, text from the tool-call marker on is held back
and sent as parsed `tool_calls` at the end. `on_final` is told of every
finished sample (session records). Admission happened before
the response started (a full queue is a 429, not a broken stream); an error
mid-stream is sent as an `error` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from flywheel.errors import FlywheelError
from services.rollout.openai_api.chat import ChatTurn, reply_of
from services.rollout.serving.core import Reservation, RolloutCore
from services.rollout.engine.base import Delta, SampleOutput, SamplingSpec
from services.rollout.openai_api.openai_protocol import (
    ChatRequest, CompletionRequest, chat_logprobs, completion_logprobs, envelope, new_id, sample_version, usage,
)
from services.rollout.serving.prompts import ResolvedPrompt


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_event(exc: BaseException) -> str:
    status = 429 if getattr(exc, "code", "") == "RESOURCE_EXHAUSTED" else 400 if isinstance(exc, FlywheelError) else 500
    return sse({"error": {"message": str(exc), "type": "server_error" if status == 500 else "invalid_request_error",
                           "code": status}})


async def merged(core: RolloutCore, prompts: list[ResolvedPrompt], spec: SamplingSpec, reservation: Reservation,
                 paced: dict[str, int]) -> AsyncIterator[tuple[int, list[Delta]]]:
    """(prompt index, deltas) from every prompt's stream as they arrive; `paced`: a session's step and version."""
    if len(prompts) == 1:
        async for deltas in core.generate_stream(prompts[0], spec, reservation, **paced):
            yield 0, deltas
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    # One reservation covers every prompt: released once all streams ended.
    remaining = len(prompts)

    async def pump(i: int, prompt: ResolvedPrompt) -> None:
        try:
            async for deltas in core.generate_stream(prompt, spec, _Shared(reservation), **paced):
                await queue.put((i, deltas))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        reservation.release()


class _Shared:
    """A reservation held by several streams; the owner releases it."""

    def __init__(self, owner: Reservation) -> None:
        self.samples = owner.samples

    def release(self) -> None:
        pass


async def completion_stream(core: RolloutCore, body: CompletionRequest, prompts: list[ResolvedPrompt],
                            spec: SamplingSpec, reservation: Reservation,
                            on_final: Callable[[list[int], SampleOutput], None],
                            paced: dict[str, int]) -> AsyncIterator[str]:
    rid, completion_tokens = new_id("cmpl"), 0
    base = envelope("text_completion", rid, core.model_name)
    offsets: dict[int, int] = {}
    try:
        async for p, deltas in merged(core, prompts, spec, reservation, paced):
            for d in deltas:
                index = p * spec.n + d.index
                choice: dict[str, Any] = {"index": index, "text": d.text, "logprobs": None, "finish_reason": None,
                                          "token_ids": d.token_ids}
                if body.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(core.codec, d.token_ids, d.logprobs, d.top_logprobs,
                                                             offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(d.text)
                chunk = {**base, "choices": [choice]}
                if d.final is not None:
                    f = d.final
                    on_final(prompts[p].ids, f)
                    completion_tokens += len(f.token_ids)
                    choice["finish_reason"] = f.finish_reason
                    choice["stop_reason"] = f.stop_reason or None
                    choice["prompt_token_ids"] = prompts[p].ids
                    choice["weight_version"] = chunk["weight_version"] = sample_version(f)
                yield sse(chunk)
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage(sum(len(p.ids) for p in prompts), completion_tokens)})
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _error_event(exc)
    yield "data: [DONE]\n\n"


async def chat_stream(core: RolloutCore, body: ChatRequest, turn: ChatTurn, spec: SamplingSpec,
                      reservation: Reservation,
                      on_final: Callable[[SampleOutput, dict[str, Any]], None],
                      paced: dict[str, int]) -> AsyncIterator[str]:
    rid, completion_tokens = new_id("chatcmpl"), 0
    base = envelope("chat.completion.chunk", rid, core.model_name)
    prompt = turn.prompt
    texts: dict[int, str] = {}
    sent: dict[int, int] = {}
    try:
        for index in range(spec.n):
            yield sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                       "prompt_token_ids": prompt.ids})
        async for _, deltas in merged(core, [prompt], spec, reservation, paced):
            for d in deltas:
                i = d.index
                texts[i] = d.final.text if d.final is not None else texts.get(i, "") + d.text
                full, start = texts[i], sent.get(i, 0)
                end = len(full) if d.final is not None or not turn.parses_calls else turn.tool_format.streamable_prefix(full)
                delta: dict[str, Any] = {"content": full[start:end]} if end > start else {}
                finish = None
                if d.final is not None:
                    completion_tokens += len(d.final.token_ids)
                    reply, finish = reply_of(turn, d.final)
                    on_final(d.final, reply)
                    if calls := reply.get("tool_calls"):
                        head = (reply["content"] or "")[start:]
                        delta = {"content": head} if head else {}
                        delta["tool_calls"] = [{**c, "index": k} for k, c in enumerate(calls)]
                sent[i] = max(start, end)
                choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish, "token_ids": d.token_ids,
                                          "logprobs": chat_logprobs(core.codec, d.token_ids, d.logprobs, d.top_logprobs)
                                          if body.logprobs else None}
                chunk = {**base, "choices": [choice]}
                if d.final is not None:
                    f = d.final
                    choice["stop_reason"] = f.stop_reason or None
                    choice["weight_version"] = chunk["weight_version"] = sample_version(f)
                yield sse(chunk)
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(prompt.ids), completion_tokens)})
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _error_event(exc)
    yield "data: [DONE]\n\n"


class TurnEvents(Protocol):
    """A dialect's stream of one chat turn's events (the Responses API's, the Messages API's)."""

    def start(self, prompt_ids: list[int]) -> list[str]: ...

    def text(self, delta: str) -> list[str]: ...

    def finish(self, reply: dict[str, Any], sample: SampleOutput, prompt_ids: list[int]) -> list[str]: ...

    def error(self, exc: BaseException) -> list[str]: ...


async def turn_stream(core: RolloutCore, turn: ChatTurn, spec: SamplingSpec, reservation: Reservation,
                      events: TurnEvents, finished: Callable[[SampleOutput], dict[str, Any]],
                      paced: dict[str, int]) -> AsyncIterator[str]:
    """One chat turn streamed in a dialect's events: text as it comes (from a tool-call marker on, held
    back until the call is parsed), then the reply `finished` makes of the sample; an error mid-stream
    is reported in-band (the status line is already sent)."""
    for event in events.start(turn.prompt.ids):
        yield event
    text, sent = "", 0
    try:
        async for deltas in core.generate_stream(turn.prompt, spec, reservation, **paced):
            for d in deltas:
                if d.final is None:
                    text += d.text
                    end = turn.tool_format.streamable_prefix(text) if turn.parses_calls else len(text)
                    for event in events.text(text[sent:end]):
                        yield event
                    sent = max(sent, end)
                    continue
                reply = finished(d.final)
                for event in events.text((reply.get("content") or "")[sent:]):
                    yield event
                for event in events.finish(reply, d.final, turn.prompt.ids):
                    yield event
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        for event in events.error(exc):
            yield event

