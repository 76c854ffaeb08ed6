"""Structured output for the transformers engine: the request's xgrammar
structural tag (`OutputConstraint`, the form vLLM's structured-output backend
takes too) enforced while sampling, as vLLM does it: before each token the
grammar's allowed tokens are computed, everything else is masked out of the
logits (before temperature, top-k and top-p), and the drawn token is fed back
to the grammar.

Each constrained position's allowed set is what the sampler's kept set is cut
from, so a constrained sample records it (flywheel.common.kept, flagged
`constrained`): the trainer takes the token's log-prob over the same set.
"""

from __future__ import annotations

from typing import Any

import torch

from flywheel.common.types import OutputConstraint
from flywheel.errors import InvalidArgument


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def matcher(self, constraint: OutputConstraint) -> Grammar:
        import xgrammar as xgr

        if constraint.kind != "structural_tag":
            raise InvalidArgument(f"structured output: unknown constraint kind {constraint.kind!r}")
        try:
            compiled = self._compiler.compile_structural_tag(constraint.value)
        except Exception as exc:  # xgrammar's InvalidJSONError, InvalidStructuralTagError, RuntimeError
            raise InvalidArgument(f"structured output: {exc}") from None
        return Grammar(xgr.GrammarMatcher(compiled), self.vocab_size)


class Grammar:
    """One sample's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, bool [vocab]."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0]
        return ((words[:, None] >> self._bits) & 1).reshape(-1)[: self._vocab].bool()

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which it allowed")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
