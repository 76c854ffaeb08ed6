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
        processed = process_logits(logits.float(), self.spec, self.prompt_ids + self.out_ids, len(self.out_ids), self.stop_ids)
        token = choose(processed, self.spec, self.generator)
        reported = torch.log_softmax(logits.float() if self.spec.logprobs_mode == "raw" else processed, dim=-1)
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
