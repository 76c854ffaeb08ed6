"""The sampler's kept set: the tokens a sampled token could have been drawn from.

Top-k, top-p and min-p cut the vocabulary to a kept set before a token is
drawn, and a grammar (structured output, a forced tool call) cuts it to the
tokens it allows; the processed log-prob of the drawn token is renormalised
over that set. The trainer must take its log-prob over the same set for the
importance ratio to compare like with like. Rebuilt from the trainer's own
logits the set is exact only on the sampling weights: for a stale sample
(fully-async, a few versions old) the two sets differ. So the rollout records
the set where a cut applied (`KeptSet`, one per such completion position):

- its ids, when it has at most `max_ids` tokens (the trainer then uses
  exactly that support);
- otherwise its size alone (the trainer keeps as many of its own most likely
  tokens); a *constrained* position whose allowed set is too big to carry
  cannot be rebuilt at all: the controller excludes its token from the loss
  (and counts it, `sampler/constrained_excluded_tokens`).

Carried as `common.Sample.kept_sets` and, per position, as TrainBatch
`sampler_kept_size` / `sampler_kept_ids`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

#: Kept sets of at most this many tokens travel as their ids (the rollout's engine.max_kept_ids).
DEFAULT_MAX_IDS = 64


class KeptSet(NamedTuple):
    """The kept set the completion token at `position` was drawn from."""

    #: Index of the completion token, from 0.
    position: int
    #: How many tokens were kept (>= 1); for a constrained set too big to carry, vLLM knows a lower bound only
    #: (the controller leaves such a token out of the loss whatever its size).
    size: int
    #: The kept ids, ascending, when `size` <= the limit; () when too big to carry.
    token_ids: tuple[int, ...] = ()
    #: A grammar constrained the position (its allowed tokens, cut further by top-k/top-p).
    constrained: bool = False

    @property
    def carried(self) -> bool:
        return bool(self.token_ids)


def kept_set(processed: torch.Tensor, position: int, max_ids: int, constrained: bool = False) -> KeptSet | None:
    """The kept set of one position's processed logits (-inf outside it); None when nothing was cut."""
    kept = torch.isfinite(processed)
    size = int(kept.sum())
    if size == processed.numel():
        return None
    ids = tuple(int(i) for i in kept.nonzero()[:, 0]) if size <= max_ids else ()
    return KeptSet(position, size, ids, constrained)


def check_kept(sets: Sequence[KeptSet], completion: Sequence[int], what: str = "kept_sets") -> None:
    """ValueError unless the sets are in order, within the completion, and each holds its token."""
    last = -1
    for i, k in enumerate(sets):
        if not last < k.position < len(completion):
            raise ValueError(f"{what}[{i}]: position {k.position} is out of order or past the completion's "
                             f"{len(completion)} tokens")
        if k.size < 1 or (k.token_ids and len(k.token_ids) != k.size):
            raise ValueError(f"{what}[{i}]: size {k.size} with {len(k.token_ids)} ids")
        if k.token_ids and completion[k.position] not in k.token_ids:
            raise ValueError(f"{what}[{i}]: token {completion[k.position]} is not in its own kept set")
        last = k.position


def shifted(sets: Iterable[KeptSet], offset: int) -> list[KeptSet]:
    """`sets` moved `offset` tokens on (a turn's sets placed in a multi-turn response)."""
    return [k._replace(position=k.position + offset) for k in sets]
