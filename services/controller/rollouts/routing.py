"""A multi-turn episode's mixture-of-experts routing, from its model calls' records.

Each call records the experts chosen for every token it fed: its prompt (the
episode so far) and its completion but the last token. The last call's
record covers the whole episode but its last token; its prefill recomputed
the earlier calls' completion tokens, though, possibly on newer weights, so
each earlier call's own completion positions are taken from its own record
(the routing that actually produced the tokens sampled after them). A call
without a record leaves the episode without one: the trainer then routes it
itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def episode_routing(calls: Sequence[tuple[int, Any]]) -> Any:
    """`calls`: (the call's prompt length, its routed experts [prompt + completion - 1, L, K] or None), in
    order; the episode's routing (numpy), or None when any call has none."""
    if not calls or any(routed is None for _, routed in calls):
        return None
    out = calls[-1][1].copy()
    for prompt_len, routed in calls[:-1]:
        out[prompt_len:routed.shape[0]] = routed[prompt_len:]
    return out
