"""OpenAI request models and response bodies, plus Flywheel's extensions.

Requests: unknown parameters and values of the wrong JSON type are refused
(400 naming them), so a typo never silently changes sampling. Responses are what the official SDK parses, plus
extra fields it ignores: `prompt_token_ids`, each choice's `token_ids` and
`weight_version` {start, end, spans} (spans: [version, start, end] triples over
its token_ids, the version that produced each token: flywheel.common.provenance),
and the response's `weight_version` (the lowest start and highest end over its
choices).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.rollout.engine.base import SampleOutput
from services.rollout.engine.text import TextCodec


class _Strict(BaseModel):
    # Strict types too: "1" is not a number and 1 is not true, as OpenAI's API and this API's
    # OpenAPI document (services.rollout.openai_api.openapi) say.
    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported(self) -> list[str]:
        return []


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(_Strict):
    model: str | None = None
    n: int | None = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, same names and meanings.
    top_k: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    #: Flywheel: caller's id for the request (reported when Pause aborts it).
    request_id: str | None = None

    def unsupported(self) -> list[str]:
        """Parameters set to values this server does not implement."""
        bad = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [name for name in ("echo", "suffix") if getattr(self, name)]
        if self.best_of is not None and self.best_of != (self.n or 1):
            bad.append("best_of")
        return bad


class ChatRequest(_Common):
    messages: list[Any]
    tools: list[Any] | None = None
    #: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    #: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class ResponsesRequest(_Strict):
    """POST /v1/responses. Stored-conversation features resolve only within a session."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}.
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # Accepted and echoed, or meaningless here: nothing is stored beyond the session's records.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    # vLLM's extensions and Flywheel's, as in chat completions.
    top_k: int | None = None
    seed: int | None = None
    request_id: str | None = None

    def unsupported(self) -> list[str]:
        return ["reasoning"] if self.reasoning and self.reasoning.get("effort") not in (None, "none", "minimal") else []


class OpenSessionRequest(_Strict):
    """POST /v1/sessions (Flywheel); the body may be empty."""

    ttl_seconds: float | None = Field(None, gt=0, le=7 * 86400)
    #: "run_step" and "min_weight_version" (whole numbers) pace the session's calls like the controller's Generate.
    metadata: dict[str, str] | None = None


class FinishSessionRequest(_Strict):
    """POST /sessions/{id}/v1/finish (Flywheel); the body may be empty."""

    reward: float | None = Field(None, allow_inf_nan=False)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sample_version(sample: SampleOutput) -> dict[str, Any]:
    """A choice's `weight_version` extension: its first and last token's versions and the spans between."""
    return {"start": sample.version_start, "end": sample.version_end,
            "spans": [[s.version, s.start, s.end] for s in sample.version_spans]}


def version_of(samples: list[SampleOutput]) -> dict[str, int]:
    return {"start": min(s.version_start for s in samples), "end": max(s.version_end for s in samples)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(codec: TextCodec, ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], offset: int = 0) -> dict[str, Any]:
    tokens = [codec.token_text(t) for t in ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [{codec.token_text(t): lp for t, lp in alts} for alts in top] if top else None,
        "text_offset": offsets,
    }


def chat_logprobs(codec: TextCodec, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict[str, Any]:
    def entry(token: int, lp: float) -> dict[str, Any]:
        text = codec.token_text(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for i, (token, lp) in enumerate(zip(ids, logprobs)):
        item = entry(token, lp)
        item["top_logprobs"] = [entry(t, v) for t, v in top[i]] if i < len(top) else []
        content.append(item)
    return {"content": content}


def envelope(kind: str, rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}
