"""Words every service shares, defined once: how to sample and why a sample ended.

Plain Python (no grpc, no protobuf), so domain modules of any service use
them; the servicers and clients translate them to `common.v1` messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FinishReason(str, Enum):
    """Why a sample ended (a str: compares equal to "stop", "length", ...)."""

    #: A stop string, a stop token or EOS.
    STOP = "stop"
    #: max_tokens, or the model's context.
    LENGTH = "length"
    #: Cut short (e.g. a weight update in ABORT mode): retry it.
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class OutputConstraint:
    """What the generated text must match (structured output), enforced by the engine while it samples."""

    #: "structural_tag": `value` is an xgrammar structural tag, as JSON text (the one kind so far).
    kind: str
    value: str = ""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters, with vLLM's names, meanings and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    #: -1 disables the top-k cut-off.
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: Alternatives returned per position; the chosen token's log-prob is always returned.
    top_logprobs: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    #: Structured output (OpenAI's response_format, forced tool calls); None: free text.
    constraint: OutputConstraint | None = None
