"""vLLM's request outputs in Flywheel's terms: a sample's deltas as they stream in, and, once it
finishes, its weight-version spans, routed experts and prompt log-probs, each checked before it is
passed on."""

from __future__ import annotations

import logging
from typing import Any

import torch

from flywheel.common.kept import KeptSet
from flywheel.common.provenance import VersionSpan, check_spans
from flywheel.errors import FailedPrecondition

log = logging.getLogger(__name__)


class SampleDeltas:
    """Accumulates one sample's deltas (vLLM sends only what is new)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.text = ""
        self.done = False
        #: The sampler's kept set where a cut applied and vLLM's top log-probs showed all of it.
        self.kept: list[KeptSet] = []
        #: vLLM's prompt log-probs as they come (a long prompt's prefill chunks each add theirs when streamed):
        #: None first (the first token's), then {token id: Logprob} per prompt position.
        self.prompt: list[Any] = []


def version_spans(spans: list[Any], length: int) -> list[VersionSpan]:
    """vLLM's weight-version spans of a finished completion (the engine core stamps each step with the
    version we set after a swap) as ours. Spans that do not cover the completion exactly are not
    passed on as if they did: none are, and consumers attribute every token to the sample's start."""
    ours = [VersionSpan(int(s.version), int(s.start), int(s.end)) for s in spans]
    try:
        check_spans(ours, length)
    except ValueError as exc:
        log.warning("vLLM's weight-version spans left out: %s", exc)
        return []
    return ours


def routed_experts(routed: Any, tokens: int) -> torch.Tensor | None:
    """vLLM's routed experts of a finished sample (numpy [positions, layers, k], uint8 or uint16), which it
    returns only from its Model Runner V2 with the engine arg enable_return_routed_experts (a GPU build:
    the CPU build's V1 runner cannot), as ours: the positions fed, prompt + completion - 1 (a last row for
    the final token, never fed, dropped). Anything else is left out, with a warning: None."""
    if routed is None:
        return None
    ids = torch.from_numpy(routed.astype("int16") if routed.dtype.itemsize > 1 else routed)
    if ids.dim() != 3 or ids.shape[0] not in (tokens - 1, tokens):
        log.warning("vLLM's routed experts left out: shape %s for %d tokens", list(ids.shape), tokens)
        return None
    return ids[: tokens - 1].contiguous()


def prompt_logprobs(entries: list[Any], prompt_ids: list[int], finished: bool) -> list[float]:
    """log p(prompt[i + 1] | prompt[:i + 1]) from vLLM's prompt log-probs (None for the first token, then
    each position's {token id: Logprob}, the prompt's own token among them); [] when none came (not asked).
    A sample that did not finish (aborted, failed) may have stopped part way through its prefill: it gets
    [] unless it has them all."""
    if not entries:
        return []
    if entries[0] is not None or len(entries) != len(prompt_ids):
        if not finished:
            return []
        raise FailedPrecondition(f"vLLM returned {len(entries)} prompt log-probs for a prompt of {len(prompt_ids)} "
                                 "tokens")
    return [float(entry[token].logprob) for entry, token in zip(entries[1:], prompt_ids[1:])]
