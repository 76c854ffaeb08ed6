"""Words every service shares, defined once: how to sample, why a sample
ended, which distribution a log-prob is of, and what happens to in-flight
requests while weights change.

Plain Python types, so domain modules of any service use them; their wire
conversions are derived here from the `common.v1` enums they are named after
(`FINISH_REASON_<NAME>`, `PAUSE_MODE_<NAME>`; `proto_enum_names`), the one
table of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from collections.abc import Callable
from typing import Any, Literal, get_args

from flywheel.common.v1 import common_pb2 as pb


class FinishReason(str, Enum):
    """Why a sample ended (a str: compares equal to "stop", "length", ...)."""

    #: A stop string, a stop token or EOS.
    STOP = "stop"
    #: max_tokens, or the model's context.
    LENGTH = "length"
    #: Cut short (e.g. a weight update in ABORT mode): retry it.
    ABORT = "abort"
    ERROR = "error"


def finish_reason_to_pb(reason: FinishReason | str) -> int:
    return pb.FinishReason.Value(f"FINISH_REASON_{FinishReason(reason).name}")


def finish_reason_from_pb(value: int) -> FinishReason:
    """ValueError for UNSPECIFIED or a number the proto does not define."""
    return FinishReason[pb.FinishReason.Name(value).removeprefix("FINISH_REASON_")]


#: What happens to a replica's in-flight requests while its weights change:
#: abort (they end with ABORT and are retried), wait (they finish first),
#: keep (frozen in place, they continue on the new weights).
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


def proto_enum_names(enum: Any, prefix: str) -> tuple[Callable[[str | None], int], Callable[[int], str | None]]:
    """(to_pb, from_pb) between the lower-case names of a proto enum's values, `<prefix><NAME>`,
    and their numbers: None is UNSPECIFIED (0) both ways; a name or number the proto does not
    define is a ValueError."""

    def to_pb(name: str | None) -> int:
        return enum.Value(f"{prefix}{name.upper()}") if name else 0

    def from_pb(value: int) -> str | None:
        return enum.Name(value).removeprefix(prefix).lower() if value else None

    return to_pb, from_pb


pause_mode_to_pb, pause_mode_from_pb = proto_enum_names(pb.PauseMode, "PAUSE_MODE_")


#: Which distribution a sample's log-probs are of (vLLM's logprobs_mode): processed, the one
#: the token was drawn from (after penalties, temperature, top-k and top-p, renormalised);
#: raw, the model's own (temperature 1, nothing truncated).
LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


logprobs_mode_to_pb, logprobs_mode_from_pb = proto_enum_names(pb.LogprobsMode, "LOGPROBS_MODE_")


@dataclass(frozen=True)
class SampledDistribution:
    """The distribution a sample's log-probs are of, as the trainer replays it (the sampling
    contract): log softmax(logits / temperature) over the top_k most likely tokens, then over
    the smallest most-likely set whose mass reaches top_p, renormalised. (1, 0, 1) is raw."""

    temperature: float = 1.0
    #: 0: no top-k cut-off.
    top_k: int = 0
    #: 1: no nucleus cut-off.
    top_p: float = 1.0
    #: The engine also applied a repetition penalty or min_tokens masking (not replayed).
    penalised: bool = False

    @property
    def raw(self) -> bool:
        return self.temperature == 1.0 and self.top_k <= 0 and self.top_p >= 1.0 and not self.penalised

    def to_pb(self) -> pb.SampledDistribution:
        return pb.SampledDistribution(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                      penalised=self.penalised)

    @classmethod
    def from_pb(cls, d: pb.SampledDistribution) -> SampledDistribution:
        """An unset message (an older sender) reads as raw."""
        return cls(temperature=d.temperature or 1.0, top_k=max(d.top_k, 0), top_p=d.top_p or 1.0, penalised=d.penalised)


RAW = SampledDistribution()


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
    #: Which log-probs the caller wants (LogprobsMode); None: the engine's.
    logprobs_mode: str | None = None
    #: Also score the prompt: each sample's log-probs of its prompt tokens, of the model's raw distribution.
    prompt_logprobs: bool = False
    #: The resident LoRA adapter to sample with, by name (services.rollout.serving.adapters); None: the base weights.
    adapter: str | None = None

    def distribution(self, mode: str) -> SampledDistribution:
        """What log-probs in `mode` of a sample drawn with this spec are of. Greedy samples
        have no sampling distribution: theirs are raw, after penalties (vLLM and our engine agree)."""
        if mode == "raw":
            return RAW
        penalised = self.repetition_penalty != 1.0 or self.min_tokens > 0
        if self.temperature == 0:
            return SampledDistribution(penalised=penalised)
        return SampledDistribution(
            temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p, penalised=penalised,
        )

    def logprobs_differ(self) -> bool:
        """Whether processed and raw log-probs of this spec's samples differ."""
        return not self.distribution("processed").raw
