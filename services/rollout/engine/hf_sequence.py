"""One sample being decoded by the transformers engine: sampling from logits,
stop conditions and incremental text, the way vLLM does them.

Log-probs are of the distribution the spec's `logprobs_mode` names, as vLLM's
sampler computes them: processed (the one the token was drawn from: after
penalties, min_tokens masking, temperature, top-k and top-p, renormalised over
the kept tokens; greedy samples: after penalties only), or raw (the model's).
Prompt log-probs (`SamplingSpec.prompt_logprobs`) are always raw, as vLLM's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flywheel.common.kept import DEFAULT_MAX_IDS, KeptSet, kept_set
from flywheel.common.provenance import spans_of
from services.rollout.engine.base import Delta, FinishReason, SampleOutput, SamplingSpec

# U+FFFD at the end of decoded text means a multi-byte character is still incomplete.
_INCOMPLETE = "\ufffd"
# Prompt positions scored at a time: bounds the float32 copy of the logits log_softmax makes.
_SCORE_ROWS = 256


def process_logits(logits: torch.Tensor, spec: SamplingSpec, seen: list[int], n_out: int, stop_ids: set[int]) -> torch.Tensor:
    """Logits after penalties, min_tokens masking, temperature, top-k and top-p."""
    logits = logits.clone()
    if spec.repetition_penalty != 1.0 and seen:
        idx = torch.tensor(sorted(set(seen)), dtype=torch.long)
        picked = logits[idx]
        logits[idx] = torch.where(picked > 0, picked / spec.repetition_penalty, picked * spec.repetition_penalty)
    if n_out < spec.min_tokens and stop_ids:
        logits[torch.tensor(sorted(stop_ids), dtype=torch.long)] = -float("inf")
    if spec.temperature == 0:
        return logits
    logits = logits / spec.temperature
    if 0 < spec.top_k < logits.numel():
        kth = torch.topk(logits, spec.top_k).values[-1]
        logits[logits < kth] = -float("inf")
    if spec.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top one always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= spec.top_p
        logits[order[drop]] = -float("inf")
    return logits


def choose(logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator | None) -> int:
    if spec.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Sequence:
    """Decoding state of one sample (mutated only by the engine's worker thread)."""

    request_id: str
    index: int
    prompt_ids: list[int]
    spec: SamplingSpec
    generator: torch.Generator | None
    eos_ids: set[int]
    max_len: int
    #: Model cache (past key values); None before the prompt is prefilled.
    cache: Any = None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    emitted_text: int = 0
    emitted_tokens: int = 0
    #: The weight version that produced each token of `out_ids`.
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: str = ""
    #: log p(prompt[i + 1] | prompt[:i + 1]) when the spec asks (`score_prompt`).
    prompt_logprobs: list[float] = field(default_factory=list)
    #: Kept sets of at most this many tokens are recorded with their ids.
    max_kept_ids: int = DEFAULT_MAX_IDS
    #: The sampler's kept set where a cut applied (processed log-probs only).
    kept: list[KeptSet] = field(default_factory=list)
    #: MoE routing of the tokens fed so far, [fed, L, K] per forward (`record_routing`).
    routing: list[torch.Tensor] = field(default_factory=list)
    #: The structured-output grammar the sample must match (hf_grammar), None: free text.
    grammar: Any = None

    @property
    def cuts(self) -> bool:
        """Whether the processed distribution is a cut of the vocabulary the trainer must be told about."""
        spec = self.spec
        return (spec.logprobs_mode != "raw" and spec.temperature != 0
                and (0 < spec.top_k or spec.top_p < 1.0))

    def record_routing(self, picked: torch.Tensor, recomputed: bool) -> None:
        """The experts chosen for the tokens the last forward fed (all of them again after a swap dropped the
        cache: the newest computation of a position is the one kept)."""
        if recomputed:
            self.routing.clear()
        self.routing.append(picked)

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.spec.stop_token_ids)
        if not self.spec.ignore_eos:
            ids |= self.eos_ids
        return ids

    def next_input(self) -> list[int]:
        # Without a cache (first step, or dropped after a weight swap) the whole
        # context is recomputed, so no token ever sees keys from other weights.
        return self.prompt_ids + self.out_ids if self.cache is None else self.out_ids[-1:]

    def score_prompt(self, logits: torch.Tensor) -> None:
        """Keeps the log-prob of each prompt token after the first under the model's raw distribution, from
        the prefill's logits at prompt positions 0 .. len - 2 (position i predicts token i + 1)."""
        targets = torch.tensor(self.prompt_ids[1:], dtype=torch.long, device=logits.device)
        scored = []
        for start in range(0, len(targets), _SCORE_ROWS):
            rows = torch.log_softmax(logits[start:start + _SCORE_ROWS].float(), dim=-1)
            scored.append(rows.gather(-1, targets[start:start + _SCORE_ROWS, None])[:, 0])
        self.prompt_logprobs = torch.cat(scored).tolist() if scored else []

    def step(self, logits: torch.Tensor, codec: Any, version: int) -> None:
        """Samples one token from the last position's logits and updates the state."""
        logits = logits.float()
        constrained = self.grammar is not None and not self.grammar.terminated
        if constrained:
            # As vLLM applies a grammar: masked out of the logits before anything else.
            logits = logits.masked_fill(~self.grammar.allowed(), -float("inf"))
        processed = process_logits(logits, self.spec, self.prompt_ids + self.out_ids, len(self.out_ids), self.stop_ids)
        token = choose(processed, self.spec, self.generator)
        if constrained:
            self.grammar.accept(token)
        reported = torch.log_softmax(logits if self.spec.logprobs_mode == "raw" else processed, dim=-1)
        if (self.cuts or (constrained and self.spec.logprobs_mode != "raw")) and (
                kept := kept_set(processed, len(self.out_ids), self.max_kept_ids, constrained)) is not None:
            self.kept.append(kept)
        self.versions.append(version)
        self.out_ids.append(token)
        self.logprobs.append(float(reported[token]))
        if self.spec.top_logprobs:
            values, ids = torch.topk(reported, self.spec.top_logprobs)
            # Processed log-probs are -inf outside the kept set: those tokens could not be drawn, and
            # -inf has no JSON form; alternatives are the tokens the distribution can give.
            self.top.append([(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != -float("inf")])
        self._check_stop(token, codec)

    def _check_stop(self, token: int, codec: Any) -> None:
        n = len(self.out_ids)
        self.text = codec.decode(self.out_ids, skip_special_tokens=self.spec.skip_special_tokens)
        if n >= self.spec.min_tokens:
            if token in self.spec.stop_token_ids:
                self.finish, self.stop_reason = "stop", str(token)
                return
            if token in self.eos_ids and not self.spec.ignore_eos:
                self.finish = "stop"
                return
            for s in self.spec.stop:
                # Only a match that ends in the newest text is new.
                at = self.text.find(s, max(0, self.emitted_text - len(s)))
                if at >= 0:
                    self.text = self.text[:at]
                    self.finish, self.stop_reason = "stop", s
                    return
        if n >= self.spec.max_tokens or len(self.prompt_ids) + n >= self.max_len:
            self.finish = "length"

    def end(self, reason: FinishReason) -> None:
        if self.finish is None:
            self.finish = reason

    def _routed_experts(self) -> torch.Tensor | None:
        if not self.routing:
            return None
        fed = torch.cat(self.routing)
        # The last token is never fed; a sample that ended before its prefill has nothing to give.
        want = len(self.prompt_ids) + len(self.out_ids) - 1
        return fed[:want] if fed.shape[0] >= want else None

    def delta(self, version: int, *, stream: bool) -> Delta | None:
        """What is new since the last delta (None if nothing); with the final sample once finished."""
        final = None
        if self.finish is not None:
            text_end = len(self.text)
            final = SampleOutput(
                index=self.index,
                token_ids=list(self.out_ids),
                logprobs=list(self.logprobs),
                top_logprobs=[list(t) for t in self.top],
                text=self.text,
                finish_reason=self.finish,
                stop_reason=self.stop_reason,
                version_start=self.versions[0] if self.versions else version,
                version_end=self.versions[-1] if self.versions else version,
                version_spans=spans_of(self.versions),
                distribution=self.spec.distribution(self.spec.logprobs_mode or "processed"),
                prompt_logprobs=list(self.prompt_logprobs),
                kept_sets=list(self.kept),
                routed_experts=self._routed_experts(),
            )
        elif not stream:
            return None
        else:
            # Hold back an incomplete character and anything that could still
            # become a stop string, so streamed text never has to be taken back.
            hold = max((len(s) - 1 for s in self.spec.stop), default=0)
            text_end = max(self.emitted_text, len(self.text.rstrip(_INCOMPLETE)) - hold)
        tokens = slice(self.emitted_tokens, len(self.out_ids))
        delta = Delta(
            index=self.index,
            token_ids=self.out_ids[tokens],
            logprobs=self.logprobs[tokens],
            top_logprobs=self.top[tokens],
            text=self.text[self.emitted_text:text_end],
            final=final,
        )
        self.emitted_tokens, self.emitted_text = len(self.out_ids), text_end
        if final is None and not delta.token_ids and not delta.text:
            return None
        return delta
